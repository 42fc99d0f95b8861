"""Checkpoint loading: the three expert layouts, shards, dtypes, errors, and peak memory."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.model.helpers import build_checkpoint
from vlm_catalog.model.config import ModelConfigError
from vlm_catalog.model.loader import CheckpointError, load_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_tokenizer):
    return build_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny", tiny_tokenizer, seed=11)


def copy_checkpoint(source, destination, rewrite=None, config_changes=None):
    """Copy a single-file checkpoint, optionally rewriting its tensors and config."""
    destination.mkdir(parents=True)
    for item in source.iterdir():
        if item.name not in ("model.safetensors", "config.json"):
            (destination / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(source / "model.safetensors"))
    if rewrite:
        tensors = rewrite(tensors)
    save_file(tensors, str(destination / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config.update(config_changes or {})
    (destination / "config.json").write_text(json.dumps(config))
    return destination


def state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_fused_attention_and_experts_hold_the_checkpoint_values(checkpoint):
    model = load_model(checkpoint)
    tensors = load_file(str(checkpoint / "model.safetensors"))
    prefix = "model.language_model.layers.0."
    attention = model.language_model.layers[0].self_attn
    expected_qkv = torch.cat([tensors[prefix + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(attention.qkv_proj.weight, expected_qkv)
    experts = model.language_model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, tensors[prefix + "mlp.experts.gate_up_proj"])
    assert torch.equal(model.visual.patch_embed.proj.weight, tensors["model.visual.patch_embed.proj.weight"])


def test_published_transposed_expert_layout(checkpoint, tmp_path):
    def transpose_experts(tensors):
        return {
            name: tensor.transpose(1, 2).contiguous() if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else tensor
            for name, tensor in tensors.items()
        }

    published = copy_checkpoint(checkpoint, tmp_path / "published", transpose_experts, {"transformers_version": "4.57.0.dev0"})
    assert state(load_model(published)).keys() == state(load_model(checkpoint)).keys()
    for name, tensor in state(load_model(published)).items():
        assert torch.equal(tensor, state(load_model(checkpoint))[name]), name
    # experts quantized to FP8 as they load: the same bytes and scales from either layout
    quantized, expected = state(load_model(published, quantization="fp8")), state(load_model(checkpoint, quantization="fp8"))
    assert any(t.dtype == torch.float8_e4m3fn for t in expected.values())
    for name, tensor in quantized.items():
        same_bits = tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor
        want = expected[name].view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else expected[name]
        assert torch.equal(same_bits, want), name


def split_experts(tensors):
    """The fused experts of transformers 5's checkpoints as the older per-expert tensors."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith("experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = gate[e].contiguous()
                out[f"{base}{e}.up_proj.weight"] = up[e].contiguous()
        elif name.endswith("experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def test_per_expert_layout(checkpoint, tmp_path):
    per_expert = copy_checkpoint(checkpoint, tmp_path / "per_expert", split_experts)
    expected = state(load_model(checkpoint))
    for name, tensor in state(load_model(per_expert)).items():
        assert torch.equal(tensor, expected[name]), name


def test_square_expert_shapes_follow_the_transformers_version(tmp_path, tiny_tokenizer):
    # hidden == 2 * moe_intermediate: shapes cannot tell the layouts apart
    v5 = build_checkpoint(tmp_path / "square", tiny_tokenizer, moe_intermediate_size=32, hidden_size=64)
    legacy = copy_checkpoint(
        v5, tmp_path / "square_legacy",
        lambda t: {n: x.transpose(1, 2).contiguous() if n.endswith("experts.gate_up_proj") else x for n, x in t.items()},
        {"transformers_version": "4.57.1"},
    )
    ours = load_model(v5).language_model.layers[0].mlp.experts.gate_up_proj
    assert torch.equal(load_model(legacy).language_model.layers[0].mlp.experts.gate_up_proj, ours)


def test_sharded_checkpoint_and_bfloat16(tmp_path, tiny_tokenizer):
    from vlm_catalog.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint

    sharded = make_tiny_checkpoint(tmp_path / "sharded", TinySpec(), seed=2, tokenizer=tiny_tokenizer, max_shard_size="200KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    whole = load_model(sharded)
    assert whole.language_model.layers[1].mlp.experts.down_proj.abs().sum() > 0
    half = load_model(sharded, dtype=torch.bfloat16, group_bytes=4096)
    assert half.lm_head.weight.dtype == torch.bfloat16
    assert half.language_model.inv_freq.dtype == torch.float32  # rotary stays float32
    assert torch.equal(half.lm_head.weight, whole.lm_head.weight.to(torch.bfloat16))


def test_errors_name_the_problem(checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelConfigError, match="config.json"):
        load_model(empty)
    other = copy_checkpoint(checkpoint, tmp_path / "other", config_changes={"model_type": "llama"})
    with pytest.raises(ModelConfigError, match="unsupported model_type 'llama'"):
        load_model(other)
    missing = copy_checkpoint(
        checkpoint, tmp_path / "missing",
        lambda t: {n: x for n, x in t.items() if n != "model.language_model.layers.1.self_attn.k_norm.weight"},
    )
    with pytest.raises(CheckpointError, match="language_model.layers.1.self_attn.k_norm.weight"):
        load_model(missing)
    misshaped = copy_checkpoint(
        checkpoint, tmp_path / "misshaped",
        lambda t: {**t, "model.visual.pos_embed.weight": torch.zeros(3, 5)},
    )
    with pytest.raises(CheckpointError, match=r"model.visual.pos_embed.weight has shape \[3, 5\], expected \[64, 32\]"):
        load_model(misshaped)
    no_weights = copy_checkpoint(checkpoint, tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_model(no_weights)
    with pytest.raises(CheckpointError, match="dtype"):
        load_model(checkpoint, dtype=torch.int8)
    if not torch.cuda.is_available():
        with pytest.raises(CheckpointError, match="no CUDA GPU"):
            load_model(checkpoint, device="cuda")


def test_missing_tensors_are_named_as_the_checkpoint_names_them(checkpoint, tmp_path):
    """Before, a missing k_proj was reported as the model's fused `qkv_proj.weight`, a name no
    checkpoint holds, and a missing expert as the layer's fused experts."""
    def without(*names):
        return lambda tensors: {n: x for n, x in split_experts(tensors).items() if n not in names}

    k_proj, up_proj = "model.language_model.layers.1.self_attn.k_proj.weight", "model.language_model.layers.0.mlp.experts.1.up_proj.weight"
    missing = copy_checkpoint(checkpoint, tmp_path / "missing", without(k_proj, up_proj))
    with pytest.raises(CheckpointError) as caught:
        load_model(missing)
    assert str(caught.value) == f"checkpoint lacks tensors: {up_proj}, {k_proj}"
    no_lm_head = copy_checkpoint(checkpoint, tmp_path / "no_lm_head", lambda t: {n: x for n, x in t.items() if n != "lm_head.weight"})
    with pytest.raises(CheckpointError, match="^checkpoint lacks tensors: lm_head.weight$"):
        load_model(no_lm_head)


def test_a_tied_checkpoint_whose_stored_lm_head_differs_is_refused(checkpoint, tmp_path):
    """transformers unties such a model (and warns); this engine cannot, and before it silently
    used the embeddings as lm_head: logits 3.9 away from transformers'."""
    wrong_flag = copy_checkpoint(checkpoint, tmp_path / "wrong_flag", config_changes={"tie_word_embeddings": True})
    with pytest.raises(CheckpointError, match="lm_head.weight differs from model.language_model.embed_tokens.weight: set "
                                              "tie_word_embeddings to false"):
        load_model(wrong_flag)

    def store_a_copy(tensors):
        return {**tensors, "lm_head.weight": tensors["model.language_model.embed_tokens.weight"].clone()}

    copied = load_model(copy_checkpoint(checkpoint, tmp_path / "copy", store_a_copy, {"tie_word_embeddings": True}))
    assert copied.lm_head.weight is copied.language_model.embed_tokens.weight  # as transformers writes a tied model


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"text_config": {"hidden_act": "gelu"}}, "text hidden_act 'gelu' is not supported"),
        ({"vision_config": {"hidden_act": "relu"}}, "vision hidden_act 'relu' is not supported"),
        ({"vision_config": {"out_hidden_size": 48}}, "vision out_hidden_size 48 differs from the text hidden_size"),
        ({"text_config": {"num_hidden_layers": "2"}}, "config.json is not a valid qwen3_vl_moe config: .*num_hidden_layers"),
        ({"text_config": {"rope_parameters": {"rope_type": "default", "mrope_section": [6, 4, -2],
                                              "mrope_interleaved": True, "rope_theta": 5e6}}},
         r"mrope_section \[6, 4, -2\] must have 3 entries, none negative"),
        ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"}},
         "activation_scheme 'static' is not supported"),
        # these four loaded, then: a ZeroDivisionError; every image request failing (the next two);
        # every request failing in the router's top-k
        ({"text_config": {"decoder_sparse_step": 0}}, "decoder_sparse_step 0 must be at least 1"),
        ({"vision_config": {"num_heads": 16}}, r"vision head_dim 2 \(hidden_size / num_heads\) is not a multiple of 4"),
        ({"vision_config": {"in_channels": 1}}, "vision in_channels 1: images are read as RGB, 3 channels"),
        ({"text_config": {"num_experts_per_tok": 9}}, "num_experts_per_tok 9 must be between 1 and num_experts 8"),
    ],
)
def test_configs_we_cannot_serve_are_config_errors(checkpoint, tmp_path, changes, message):
    """Before, the first three were a ValueError from the model's constructor and the fourth a
    transformers validation error: tracebacks from every front door (which catch ModelConfigError),
    and check-parity's exit 1, its code for a parity failure."""
    config = json.loads((checkpoint / "config.json").read_text())
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
    changed = copy_checkpoint(checkpoint, tmp_path / "changed", config_changes=config)
    with pytest.raises(ModelConfigError, match=message):
        load_model(changed)


def test_missing_shard_is_named(tmp_path, tiny_tokenizer):
    from vlm_catalog.model.tiny_checkpoint import TinySpec, make_tiny_checkpoint

    sharded = make_tiny_checkpoint(tmp_path / "s", TinySpec(), seed=1, tokenizer=tiny_tokenizer, max_shard_size="200KB")
    victim = sorted(sharded.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name} is listed in model.safetensors.index.json but missing"):
        load_model(sharded)


PEAK_MEMORY_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from vlm_catalog.model.loader import load_model
    from vlm_catalog.model.config import ModelConfig

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    # one-time costs that do not scale with the model: parsing a config imports
    # transformers' config classes; the first random init on the meta device
    # (nn.Embedding's normal_) imports torch's meta kernels (~150 MB)
    ModelConfig.from_pretrained(sys.argv[1])
    with torch.device("meta"):
        torch.nn.Embedding(4, 4)
    before = status("VmRSS")
    model = load_model(sys.argv[1], group_bytes=16 * 2**20)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"weights": weights, "peak_increase": status("VmHWM") - before}))
    """
)


def test_peak_memory_while_loading_stays_under_1_3x_the_weights(tmp_path):
    from vlm_catalog.model.tiny_checkpoint import TinySpec, build_tokenizer, make_tiny_checkpoint

    spec = TinySpec(hidden_size=256, moe_intermediate_size=256, num_experts=32, text_layers=4,
                    num_heads=8, num_kv_heads=4, head_dim=32, mrope_section=(8, 4, 4), tokenizer_vocab_size=400)
    checkpoint = make_tiny_checkpoint(tmp_path / "big", spec, seed=0, tokenizer=build_tokenizer(400))
    result = subprocess.run(
        [sys.executable, "-c", PEAK_MEMORY_SCRIPT, str(checkpoint)], capture_output=True, text=True, check=True
    )
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["weights"] > 50 * 2**20  # big enough that the ratio means something
    assert numbers["peak_increase"] < 1.3 * numbers["weights"], numbers
