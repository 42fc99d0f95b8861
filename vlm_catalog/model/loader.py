"""Load a Hugging Face Qwen3-VL-MoE checkpoint directory into `Qwen3VLMoeModel`.

A checkpoint directory holds `config.json` and `model.safetensors` or several
shards listed in `model.safetensors.index.json` (plus tokenizer, preprocessor
and chat-template files, read elsewhere).

Tensor names: `model.visual.*` -> `visual.*`, `model.language_model.*` ->
`language_model.*`, `lm_head.weight` as is. Our layout fuses q/k/v into
`qkv_proj` and a dense MLP's gate/up into `gate_up_proj`; the loader copies each
source tensor into its slice of the fused parameter. MoE experts come in three
layouts, all mapped onto ours (`gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`):
- transformers >= 5 `save_pretrained`: fused, exactly our layout;
- the published Qwen checkpoints (written by transformers 4.57): fused but
  transposed, `gate_up_proj [E, H, 2I]`, `down_proj [E, I, H]`;
- per-expert tensors `mlp.experts.<e>.{gate,up,down}_proj.weight` (e.g. FP8 exports).
When a fused tensor's shape cannot tell the two fused layouts apart (H == 2I or
H == I), the `transformers_version` in config.json decides.

FP8 checkpoints (Qwen's "-FP8": float8 e4m3 weights, each with a float32
`<name>_scale_inv` of block scales; vlm_catalog/model/fp8.py): `quantization`
says what the model holds.
- "auto": MoE experts stay FP8 on CUDA (half the bytes; the fused MoE widens
  them tile by tile), everything else is widened to `dtype` as it is read.
  On CPU all is widened. Unquantized checkpoints load as they are.
- "fp8": MoE experts in FP8 on any device; an unquantized checkpoint's experts
  are quantized as they are read (128 x 128 blocks, as Qwen's; fewer rows when
  the expert intermediate size is not a multiple of 128).
- "fp8_w8a8": as "fp8", and the decoder's dense projections (attention q/k/v
  and o, dense MLPs) are FP8 too (`Fp8Linear`; an FP8 checkpoint's as they
  are, others quantized as they are read); every FP8 GEMM quantizes its input
  (per token and 128 columns), for Hopper's FP8 tensor cores.
- "fp8_w8a8_channel": the same weights in FP8 with one scale per output
  channel (weight row) instead of per 128 x 128 block, and one activation
  scale per token (the "FP8 dynamic" recipe): the GEMMs apply the scales once,
  after their K loops, which keeps Hopper's wgmma asynchronous
  (kernels/jit/fused_moe.py). Unquantized weights are quantized as they are
  read; an FP8 checkpoint's blocks are widened to float32 and requantized per
  row, one weight (or expert) at a time.
- "none": every weight in `dtype`.
A float8 tensor without its scale, or a quantization method other than
block-wise FP8, is a clear error, never a silently wrong model. Scales
(`<name>_scale_inv`) are read with their weight, from a per-shard cache.

Memory: the model is built on the meta device and allocated once in the target
dtype and device; tensors are then streamed from memory-mapped safetensors in
row chunks, reopening the file every `group_bytes` so mapped pages are released.
Peak host memory is the weights plus about one group plus one copy chunk
(group_bytes / 4): 1.2x the weights on a 100 MB model with 16 MB groups, and
~1.0x on real checkpoints (tests/model/test_loader.py). Not counted: a one-time
~150 MB the first time torch runs a random init on the meta device
(`nn.Embedding`'s `normal_` imports its meta-kernel registrations), a fixed cost whatever the model size.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from kernels.fp8 import (
    FP8_DTYPE,
    dequantize,
    gpu_block_k_problem,
    per_channel_block,
    quantize,
    requantize,
)
from vlm_catalog.model.config import ModelConfig, TextConfig
from vlm_catalog.model.fp8 import (
    QUANTIZATION_MODES,
    W8A8_MODES,
    Fp8BlockQuantization,
    fitting_block,
)
from vlm_catalog.model.qwen3_vl_moe import Qwen3VLMoeModel
from vlm_catalog.model.text import Fp8Linear, MoEExperts, dense_input_widths, dense_row_counts

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_GROUP_BYTES = 256 * 2**20
SCALE_SUFFIX = "_scale_inv"  # `<weight name>_scale_inv`: the block scales of an FP8 weight
FP8_SAFETENSORS_DTYPE = "F8_E4M3"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded; the message names the file or tensor."""


def _open_shard(shard: Path):
    """`safe_open` on CPU; a damaged file (a download cut short) is a `CheckpointError` naming it."""
    try:
        return safe_open(str(shard), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise CheckpointError(
            f"{shard}: not a readable safetensors file ({exc}); was it cut short while downloading?"
        ) from None


def load_model(
    checkpoint_dir: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    group_bytes: int = DEFAULT_GROUP_BYTES,
    quantization: str = "auto",
) -> Qwen3VLMoeModel:
    """Build the model for `checkpoint_dir` and stream its weights in (`quantization`: the
    module doc's "auto", "fp8", "fp8_w8a8", "fp8_w8a8_channel" or "none")."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {checkpoint_dir}")
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise CheckpointError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    requested = device
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):  # "cuda:x", "gpu"
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise CheckpointError(f"device must be 'cpu' or 'cuda[:N]', got {str(requested)!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError("device cuda was requested but no CUDA GPU is available")
    if quantization not in QUANTIZATION_MODES:
        raise CheckpointError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; got {quantization!r}")
    config = ModelConfig.from_pretrained(checkpoint_dir)
    shards = checkpoint_shards(checkpoint_dir)
    fp8_experts = _fp8_experts(config, quantization, device)
    fp8_dense = _fp8_dense(config, quantization, device) if quantization in W8A8_MODES else None

    with torch.device("meta"):
        model = Qwen3VLMoeModel(config)
    model = model.to(dtype)
    if fp8_experts is not None:
        for experts in model.language_model.moe_experts():
            experts.use_fp8(fp8_experts)
            experts.fp8_activations = quantization in W8A8_MODES
    if fp8_dense is not None:
        try:
            model.language_model.use_fp8_linears(fp8_dense)
        except ValueError as exc:  # the block does not divide the fused parts
            raise CheckpointError(f"quantization={quantization!r}: {exc}") from None
    model = model.to_empty(device=device)
    model.visual.reset_rotary_buffers()
    model.language_model.reset_rotary_buffers()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.language_model.embed_tokens.weight

    locations = {name: shard for shard, names in shards.items() for name in names}
    plan = WeightPlan(model, config, _legacy_expert_layout(checkpoint_dir), chunk_bytes=max(1, group_bytes // 4),
                      locations=locations)
    for shard, names in shards.items():
        for group in _groups_by_size(shard, names, group_bytes):
            with _open_shard(shard) as handle:
                for name in group:
                    plan.copy(name, handle, shard)
    plan.check_complete()
    return model.requires_grad_(False).eval()


def _fp8_experts(config: ModelConfig, quantization: str, device: torch.device) -> Fp8BlockQuantization | None:
    """The block quantization the MoE experts are held in, or None (the model's dtype)."""
    text = config.text
    if quantization == "none" or text.num_experts == 0:
        return None
    if quantization == "auto" and (config.quantization is None or device.type != "cuda"):
        return None
    if quantization == "fp8_w8a8_channel":
        return Fp8BlockQuantization(*per_channel_block(text.hidden_size, text.moe_intermediate_size))
    block = config.quantization or fitting_block(text.moe_intermediate_size)
    problem = None
    if text.moe_intermediate_size % block.block_n:
        problem = f"needs moe_intermediate_size ({text.moe_intermediate_size}) to be a multiple of the block size {block.block_n}"
    elif device.type == "cuda":  # the gate/up GEMMs reduce the hidden size, down the intermediate size
        problem = gpu_block_k_problem(block.block_k, (text.hidden_size, text.moe_intermediate_size))
    if problem is not None:
        if quantization != "auto":
            raise CheckpointError(f"quantization={quantization!r} {problem}")
        logger.info("FP8 experts cannot be kept (%s): widening them", problem)
        return None
    return block


def _fp8_dense(config: ModelConfig, quantization: str, device: torch.device) -> Fp8BlockQuantization:
    """The block quantization of the dense projections under "fp8_w8a8": the checkpoint's, or
    128 x 128 with rows cut to divide the fused parts (q, k/v, the dense MLP's gate/up; the
    model checks that the block divides them). Under "fp8_w8a8_channel": a row by at least
    every projection's input width."""
    if quantization == "fp8_w8a8_channel":
        return Fp8BlockQuantization(*per_channel_block(*dense_input_widths(config.text)))
    block = config.quantization or fitting_block(*dense_row_counts(config.text))
    if device.type == "cuda" and (problem := gpu_block_k_problem(block.block_k, dense_input_widths(config.text))):
        raise CheckpointError(f"quantization={quantization!r} {problem}")
    return block


def check_checkpoint(checkpoint_dir: str | Path) -> None:
    """What loading would refuse first, without loading: config.json, the index and every shard's
    header (`ModelConfigError`, `CheckpointError`). For a driver whose workers load the model
    (`extract --ray`), so a damaged checkpoint is its one-line error, not a dead actor's report."""
    checkpoint_dir = Path(checkpoint_dir)
    ModelConfig.from_pretrained(checkpoint_dir)
    for shard in checkpoint_shards(checkpoint_dir):
        with _open_shard(shard):
            pass


def checkpoint_shards(checkpoint_dir: Path) -> dict[Path, list[str]]:
    """Shard file -> tensor names, from the index or the single file; checks files exist."""
    index_path = checkpoint_dir / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_bytes())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:  # not JSON (or not UTF-8), or no weight_map
            raise CheckpointError(f"{index_path}: not a safetensors index ({exc})") from None
        shards: dict[Path, list[str]] = {}
        for name, filename in weight_map.items():
            shards.setdefault(checkpoint_dir / filename, []).append(name)
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"{shard.name} is listed in {INDEX_FILE} but missing")
        return shards
    single = checkpoint_dir / SINGLE_FILE
    if single.is_file():
        with _open_shard(single) as handle:
            return {single: list(handle.keys())}
    raise CheckpointError(f"{checkpoint_dir}: no {SINGLE_FILE} and no {INDEX_FILE}")


@dataclass
class _Target:
    """Where one source tensor goes: `parameter[rows]` (a slice of dim 0, or expert e's slice)."""

    parameter: torch.Tensor
    name: str
    view: Callable[[torch.Tensor], torch.Tensor]
    expected_shape: tuple[int, ...]
    transposed_experts: bool = False
    # an FP8 parameter: the parameter holding its block scales, their slice, and the block
    scale_name: str | None = None
    scale_view: Callable[[torch.Tensor], torch.Tensor] | None = None
    scale_block: tuple[int, int] | None = None


_PER_EXPERT = re.compile(r"^(language_model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_ATTENTION_PART = re.compile(r"^(language_model\.layers\.\d+\.self_attn)\.(q|k|v)_proj\.(weight|bias)$")
_DENSE_MLP_PART = re.compile(r"^(language_model\.layers\.\d+\.mlp)\.(gate|up)_proj\.weight$")
_FUSED_EXPERTS = re.compile(r"^(language_model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
# the model's fused parameters that several checkpoint tensors fill (and _FUSED_EXPERTS, filled one expert at a time)
_FUSED_ATTENTION = re.compile(r"^(language_model\.layers\.\d+\.self_attn)\.qkv_proj\.(weight|bias)$")
_FUSED_DENSE_MLP = re.compile(r"^(language_model\.layers\.\d+\.mlp)\.gate_up_proj\.weight$")


class WeightPlan:
    """Maps checkpoint tensor names onto (slices of) model parameters and copies them."""

    def __init__(
        self, model: nn.Module, config: ModelConfig, legacy_expert_layout: bool, chunk_bytes: int,
        locations: dict[str, Path] | None = None,
    ) -> None:
        self.chunk_bytes = chunk_bytes
        self.locations = locations or {}  # tensor name -> shard, to find an FP8 weight's scales
        self._shard_scales: dict[Path, dict[str, torch.Tensor]] = {}  # the scales read so far, per shard
        self.quantization = config.quantization  # how the checkpoint's FP8 weights are blocked
        self.fp8_blocks = _fp8_blocks(model)  # FP8 parameter name -> its block (the model's layout)
        self.parameters = dict(model.named_parameters(remove_duplicate=False))
        self.text: TextConfig = config.text
        self.tied = config.tie_word_embeddings
        self.legacy_expert_layout = legacy_expert_layout
        self.filled = {name: 0 for name in model.state_dict() if name in self.parameters}
        if self.tied:
            self.filled.pop("lm_head.weight", None)
        self.tied_lm_head: tuple[str, Path] | None = None  # a stored lm_head of a tied model, checked at the end
        self.copied: set[str] = set()  # checkpoint names copied, without "model."
        self.skipped: list[str] = []

    def copy(self, source_name: str, handle, shard: Path) -> None:
        if source_name.endswith(SCALE_SUFFIX):
            return  # read with its weight (`_scale_of`)
        source = handle.get_slice(source_name)
        if source_name == "lm_head.weight" and self.tied:
            self.tied_lm_head = (source_name, shard)
            return
        target = self.target(source_name, tuple(source.get_shape()))
        if target is None:
            self.skipped.append(source_name)
            return
        self.copied.add(source_name.removeprefix("model."))
        destination = target.view(target.parameter)
        fp8_source = source.get_dtype() == FP8_SAFETENSORS_DTYPE
        with torch.no_grad():
            if fp8_source and destination.dtype != FP8_DTYPE:
                self._copy_widened(source_name, source, destination, target)
            elif destination.dtype == FP8_DTYPE:
                self._copy_fp8(source_name, source, destination, target, fp8_source)
            elif target.transposed_experts:
                for expert in range(destination.shape[0]):
                    destination[expert].copy_(source[expert].transpose(0, 1))
            else:
                for start, end in _row_chunks(destination, self.chunk_bytes):
                    destination[start:end].copy_(source[start:end])
        self.filled[target.name] += destination.numel()

    def _copy_widened(self, source_name: str, source, destination: torch.Tensor, target: _Target) -> None:
        """An FP8 weight into a parameter of the model's dtype: Q * scale, row chunk by row chunk."""
        if self.quantization is None:
            raise CheckpointError(f"{source_name} is float8 but config.json has no FP8 quantization_config")
        if target.transposed_experts:
            raise CheckpointError(f"{source_name}: FP8 experts in the transposed fused layout are not supported")
        scale = self._scale_of(source_name)
        block = self.quantization.block
        *leading, rows, cols = source.get_shape()  # scales of other blocks than config.json's widen wrongly
        self._check_shape(source_name + SCALE_SUFFIX, tuple(scale.shape),
                          (*leading, *self.quantization.scale_shape(rows, cols)))
        if destination.dim() == 3:  # fused experts [E, rows, cols] with scales [E, row blocks, col blocks]
            for expert in range(destination.shape[0]):
                destination[expert].copy_(dequantize(source[expert], scale[expert], block, destination.dtype))
            return
        for start, end in _row_chunks(destination, self.chunk_bytes):
            destination[start:end].copy_(dequantize(source[start:end], scale, block, destination.dtype, first_row=start))

    def _copy_fp8(self, source_name: str, source, destination: torch.Tensor, target: _Target, fp8_source: bool) -> None:
        """Into an FP8 parameter and its scale rows: an FP8 source's bytes and scales as they are,
        an unquantized source quantized here (one expert at a time)."""
        scales = target.scale_view(self.parameters[target.scale_name])
        if fp8_source:
            if target.transposed_experts:
                raise CheckpointError(f"{source_name}: FP8 experts in the transposed fused layout are not supported")
            if self.quantization is None:
                raise CheckpointError(f"{source_name} is float8 but config.json has no FP8 quantization_config")
            scale = self._scale_of(source_name)
            if self.quantization.block != target.scale_block:  # e.g. per-channel from 128 x 128 blocks
                *leading, rows, cols = source.get_shape()
                self._check_shape(source_name + SCALE_SUFFIX, tuple(scale.shape),
                                  (*leading, *self.quantization.scale_shape(rows, cols)))
                self._requantize(source, scale, destination, scales, target.scale_block)
                self.filled[target.scale_name] += scales.numel()
                return
            self._check_shape(source_name + SCALE_SUFFIX, tuple(scale.shape), tuple(scales.shape))
            for start, end in _row_chunks(destination, self.chunk_bytes):
                destination[start:end].copy_(source[start:end])
            scales.copy_(scale)
        else:
            if destination.dim() == 2:  # one weight (or one expert's)
                parts = [(destination, scales, source[:])]
            else:  # fused experts, read one expert at a time
                parts = ((destination[e], scales[e], source[e]) for e in range(destination.shape[0]))
            for weight_out, scale_out, weight in parts:
                quantized, scale = quantize(weight.transpose(0, 1) if target.transposed_experts else weight,
                                            target.scale_block)
                weight_out.copy_(quantized)
                scale_out.copy_(scale)
        self.filled[target.scale_name] += scales.numel()

    def _requantize(self, source, scale: torch.Tensor, destination: torch.Tensor, scales: torch.Tensor,
                    block: tuple[int, int]) -> None:
        """An FP8 weight in the checkpoint's blocks into the model's: widened to float32 (exact)
        and quantized again, one weight or one expert at a time."""
        checkpoint_block = self.quantization.block
        if destination.dim() == 2:
            parts = [(destination, scales, source[:], scale)]
        else:  # fused experts [E, rows, cols] with scales [E, row blocks, col blocks]
            parts = ((destination[e], scales[e], source[e], scale[e]) for e in range(destination.shape[0]))
        for weight_out, scale_out, weight, weight_scale in parts:
            quantized, new_scale = requantize(weight, weight_scale, checkpoint_block, block)
            weight_out.copy_(quantized)
            scale_out.copy_(new_scale)

    def _scale_of(self, source_name: str) -> torch.Tensor:
        """The float32 block scales of FP8 weight `source_name`. The first call for a shard reads
        all of that shard's scales (a few MB for a 30B model) so the file opens once."""
        scale_name = source_name + SCALE_SUFFIX
        shard = self.locations.get(scale_name)
        if shard is None:
            raise CheckpointError(f"{source_name} is float8 but the checkpoint has no {scale_name}")
        if shard not in self._shard_scales:
            names = [name for name, where in self.locations.items() if where == shard and name.endswith(SCALE_SUFFIX)]
            with _open_shard(shard) as handle:
                self._shard_scales[shard] = {name: handle.get_tensor(name).float() for name in names}
        return self._shard_scales[shard][scale_name]

    def target(self, source_name: str, shape: tuple[int, ...]) -> _Target | None:
        name = source_name.removeprefix("model.")
        if not name.startswith(("visual.", "language_model.", "lm_head.")):
            return None
        text = self.text
        q_size, kv_size = text.num_heads * text.head_dim, text.num_kv_heads * text.head_dim
        if match := _ATTENTION_PART.match(name):
            prefix, part, kind = match.groups()
            start = {"q": 0, "k": q_size, "v": q_size + kv_size}[part]
            length = q_size if part == "q" else kv_size
            return self._slice(source_name, f"{prefix}.qkv_proj.{kind}", shape, start, length)
        if (match := _DENSE_MLP_PART.match(name)) and f"{match.group(1)}.gate_up_proj.weight" in self.parameters:
            prefix, part = match.groups()
            size = text.intermediate_size
            return self._slice(source_name, f"{prefix}.gate_up_proj.weight", shape, 0 if part == "gate" else size, size)
        if match := _PER_EXPERT.match(name):
            prefix, expert, part = match.groups()
            expert = int(expert)
            size = text.moe_intermediate_size
            if part == "down":
                return self._expert_slice(source_name, f"{prefix}.down_proj", shape, expert, 0, None)
            return self._expert_slice(
                source_name, f"{prefix}.gate_up_proj", shape, expert, 0 if part == "gate" else size, size
            )
        if _FUSED_EXPERTS.match(name):
            return self._fused_experts(source_name, name, shape)
        if name not in self.parameters:
            return None
        return self._whole(source_name, name, shape)

    def check_complete(self) -> None:
        missing = [
            name for name, count in self.filled.items() if count != self.parameters[name].numel()
        ]
        if missing:
            absent = [source for name in missing for source in self._sources_of(name) if source not in self.copied]
            shown = ", ".join(_checkpoint_name(name) for name in absent[:8])
            shown += f" and {len(absent) - 8} more" if len(absent) > 8 else ""
            raise CheckpointError(f"checkpoint lacks tensors: {shown}")
        if self.tied_lm_head is not None:
            self._check_tied_lm_head(*self.tied_lm_head)
        if self.skipped:
            logger.info("ignored %d checkpoint tensors the model does not use", len(self.skipped))

    def _sources_of(self, name: str) -> list[str]:
        """The checkpoint tensors (without "model.") that fill parameter `name`: q/k/v for the fused
        attention projection, gate/up for a dense MLP's, one per expert for fused experts filled
        expert by expert (a fused checkpoint's one tensor, were none of them given)."""
        if name.endswith("_scale"):  # an FP8 parameter's scales come with its weight
            return self._sources_of(name.removesuffix("_scale"))
        if match := _FUSED_ATTENTION.match(name):
            prefix, kind = match.groups()
            return [f"{prefix}.{part}_proj.{kind}" for part in "qkv"]
        if match := _FUSED_DENSE_MLP.match(name):
            return [f"{match.group(1)}.{part}_proj.weight" for part in ("gate", "up")]
        if (match := _FUSED_EXPERTS.match(name)) and self.filled[name]:  # some experts given one by one
            prefix, fused = match.groups()
            parts = ("gate", "up") if fused == "gate_up_proj" else ("down",)
            return [f"{prefix}.{e}.{part}_proj.weight" for e in range(self.text.num_experts) for part in parts]
        return [name]

    def _check_tied_lm_head(self, source_name: str, shard: Path) -> None:
        """A model whose config ties lm_head to the embeddings may store lm_head too: as a copy of
        them (transformers writes one), or, in a checkpoint whose flag is wrong, as other weights
        (transformers then warns and unties them). This engine cannot untie, so it refuses."""
        embeddings = self.parameters["lm_head.weight"]  # the embedding matrix, tied
        with _open_shard(shard) as handle:
            stored = handle.get_slice(source_name)
            self._check_shape(source_name, tuple(stored.get_shape()), tuple(embeddings.shape))
            for start, end in _row_chunks(embeddings, self.chunk_bytes):
                if not torch.equal(stored[start:end].to(embeddings.device, embeddings.dtype), embeddings[start:end]):
                    raise CheckpointError(
                        f"config.json ties lm_head to the embeddings (tie_word_embeddings: true), but the checkpoint's "
                        f"{source_name} differs from model.language_model.embed_tokens.weight: set "
                        "tie_word_embeddings to false in config.json to use the stored lm_head"
                    )

    def _whole(self, source_name: str, name: str, shape: tuple[int, ...]) -> _Target:
        parameter = self.parameters[name]
        self._check_shape(source_name, shape, tuple(parameter.shape))
        self._check_not_filled(source_name, name)
        return self._with_scales(_Target(parameter, name, lambda p: p, tuple(parameter.shape)))

    def _slice(self, source_name: str, name: str, shape: tuple[int, ...], start: int, length: int) -> _Target:
        parameter = self._parameter(source_name, name)
        expected = (length, *parameter.shape[1:])
        self._check_shape(source_name, shape, expected)
        return self._with_scales(_Target(parameter, name, lambda p: p[start : start + length], expected), start, length)

    def _expert_slice(
        self, source_name: str, name: str, shape: tuple[int, ...], expert: int, start: int, length: int | None
    ) -> _Target:
        parameter = self._parameter(source_name, name)
        if not 0 <= expert < parameter.shape[0]:
            raise CheckpointError(f"{source_name}: expert {expert} is out of range ({parameter.shape[0]} experts)")
        length = parameter.shape[1] if length is None else length
        expected = (length, parameter.shape[2])
        self._check_shape(source_name, shape, expected)
        target = _Target(parameter, name, lambda p: p[expert, start : start + length], expected)
        return self._with_scales(target, start, length, expert)

    def _fused_experts(self, source_name: str, name: str, shape: tuple[int, ...]) -> _Target:
        parameter = self._parameter(source_name, name)
        ours = tuple(parameter.shape)  # [E, 2I, H] or [E, H, I]
        transposed = (ours[0], ours[2], ours[1])
        if shape == ours and shape == transposed:
            is_transposed = self.legacy_expert_layout  # square: the layout comes from the version
        elif shape in (ours, transposed):
            is_transposed = shape == transposed
        elif ours == transposed:  # square: one layout to name
            raise CheckpointError(f"{source_name}: shape {list(shape)}, expected {list(ours)}")
        else:
            raise CheckpointError(
                f"{source_name}: shape {list(shape)} fits neither {list(ours)} nor the "
                f"transposed layout {list(transposed)}"
            )
        self._check_not_filled(source_name, name)
        return self._with_scales(_Target(parameter, name, lambda p: p, ours, transposed_experts=is_transposed))

    def _with_scales(self, target: _Target, start: int = 0, length: int | None = None,
                     expert: int | None = None) -> _Target:
        """For an FP8 parameter: where the target's block scales go (`<name>_scale`; rows
        start..start+length of the weight, or all, of one expert or all)."""
        block = self.fp8_blocks.get(target.name)
        if block is None:
            return target
        target.scale_name, target.scale_block = f"{target.name}_scale", block
        if length is None:
            target.scale_view = lambda p: p
            return target
        rows = slice(start // block[0], start // block[0] + -(-length // block[0]))
        target.scale_view = (lambda p: p[rows]) if expert is None else (lambda p: p[expert, rows])
        return target

    def _parameter(self, source_name: str, name: str) -> torch.Tensor:
        if name not in self.parameters:
            raise CheckpointError(f"{source_name}: the model has no parameter {name} for it")
        return self.parameters[name]

    def _check_not_filled(self, source_name: str, name: str) -> None:
        if self.filled.get(name):
            raise CheckpointError(f"{source_name}: {name} is given twice in the checkpoint")

    @staticmethod
    def _check_shape(source_name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> None:
        if tuple(shape) != tuple(expected):
            raise CheckpointError(
                f"tensor {source_name} has shape {list(shape)}, expected {list(expected)}"
            )


def _checkpoint_name(name: str) -> str:
    """A parameter's name as a Hugging Face checkpoint spells it: under "model.", but lm_head."""
    return name if name.startswith("lm_head.") else f"model.{name}"


def _fp8_blocks(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Name -> block of every FP8 weight the model holds (its scales are `<name>_scale`)."""
    blocks = {}
    for prefix, module in model.named_modules():
        if isinstance(module, MoEExperts) and module.fp8_block is not None:
            blocks[f"{prefix}.gate_up_proj"] = blocks[f"{prefix}.down_proj"] = module.fp8_block
        elif isinstance(module, Fp8Linear):
            blocks[f"{prefix}.weight"] = module.block
    return blocks


def _row_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """Dim-0 ranges of about `chunk_bytes`, so no full-size temporary is made."""
    if tensor.dim() == 0:
        yield 0, 1
        return
    rows = tensor.shape[0]
    row_bytes = max(1, tensor[0].numel() * tensor.element_size())
    step = max(1, chunk_bytes // row_bytes)
    for start in range(0, rows, step):
        yield start, min(rows, start + step)


def _groups_by_size(shard: Path, names: list[str], group_bytes: int) -> Iterator[list[str]]:
    """Split a shard's tensors into groups of about `group_bytes`, in file order."""
    with _open_shard(shard) as handle:
        present = set(handle.keys())
        missing = [name for name in names if name not in present]
        if missing:
            raise CheckpointError(f"{shard.name} lacks tensors its index lists: {', '.join(missing[:5])}")
        sizes = {}
        for name in names:
            piece = handle.get_slice(name)
            numel = 1
            for dim in piece.get_shape():
                numel *= dim
            sizes[name] = numel * _DTYPE_BYTES.get(piece.get_dtype(), 4)
    group: list[str] = []
    total = 0
    for name in names:
        if group and total + sizes[name] > group_bytes:
            yield group
            group, total = [], 0
        group.append(name)
        total += sizes[name]
    if group:
        yield group


_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1,
                FP8_SAFETENSORS_DTYPE: 1}


def _legacy_expert_layout(checkpoint_dir: Path) -> bool:
    """True when config.json says transformers < 5 wrote the checkpoint (transposed experts)."""
    version = json.loads((checkpoint_dir / "config.json").read_bytes()).get("transformers_version", "")
    major = version.split(".")[0]
    return major.isdigit() and int(major) < 5
