"""Tuned tables (kernels/tuned_configs.py): written by the tuners, read by the MoE and decode
lookups ahead of the built-in tables, the named file over the packaged one of the GPU model,
and every broken table a clear error naming the file and the entry."""

from __future__ import annotations

import json

import pytest
import torch

from kernels import tuned_configs
from kernels.moe.configs import MOE_CONFIGS, MoeKernelConfig, get_moe_config
from kernels.moe.fused_moe import moe_gemm_config
from kernels.paged_decode_configs import (
    DecodeKernelConfig,
    default_decode_config,
    get_decode_config,
)
from kernels.tuned_configs import (
    TUNED_CONFIGS_ENV_VAR,
    Processor,
    TunedTableError,
    decode_entry,
    device_table_name,
    device_table_path,
    load_table,
    moe_entry,
    write_entries,
)

PACKAGED_DIR = tuned_configs.TABLES_DIR  # before the fixture points it elsewhere
W8A8 = "float8_e4m3fn_w8a8"
MOE_KEY = (128, 2048, 768, W8A8, 256)
TILE = MoeKernelConfig(32, 128, 128, 1, 8, 3, tuned=True)
DECODE_KEY = ("float8_e4m3fn", 128, 256)
LAUNCH = DecodeKernelConfig(block_n=32, num_warps=8, num_stages=3, programs_per_sm=4, min_split_tokens=128, tuned=True)


@pytest.fixture(autouse=True)
def fresh_tables(monkeypatch, tmp_path):
    """No table named by the environment, no packaged table, nothing read before."""
    monkeypatch.delenv(TUNED_CONFIGS_ENV_VAR, raising=False)
    monkeypatch.setattr(tuned_configs, "TABLES_DIR", tmp_path / "packaged")
    tuned_configs.clear_cache()
    yield
    tuned_configs.clear_cache()


HOPPER_132 = Processor((9, 0), 132)  # an H100 SXM's, and an H200's


def written_table(path, moe=((MOE_KEY, TILE),), decode=((DECODE_KEY, LAUNCH),), device="NVIDIA H100 80GB HBM3",
                  processor=HOPPER_132):
    return write_entries(path, device, processor=processor,
                         moe=[moe_entry(key, config, 0.2, 0.4) for key, config in moe],
                         paged_decode=[decode_entry(key, config, 0.05, 0.06) for key, config in decode])


def on_gpus(monkeypatch, models: dict[str, tuple[str | None, Processor | None]]) -> None:
    """Devices by name ("cuda:0") as GPU models with their processors, on this CPU machine."""
    monkeypatch.setattr(tuned_configs, "device_name", lambda device: models[str(device)][0])
    monkeypatch.setattr(tuned_configs, "device_processor", lambda device: models[str(device)][1])


def lookups():
    return (get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn, fp8_activations=True, device="cpu"),
            get_decode_config(torch.float8_e4m3fn, 128, 200, device="cpu"))


def test_a_written_table_reads_back_with_its_measurements(tmp_path):
    path = written_table(tmp_path / "table.json")
    table = load_table(path)
    assert table.moe == {MOE_KEY: TILE} and table.paged_decode == {DECODE_KEY: LAUNCH}
    document = json.loads(path.read_text())
    assert document["format"] == 1 and document["device"] == "NVIDIA H100 80GB HBM3"
    (entry,) = document["moe"]
    assert (entry["tokens"], entry["ms"], entry["default_ms"]) == (256, 0.2, 0.4)
    assert entry["versions"]["torch"] == torch.__version__ and entry["date"]


def test_writing_merges_replaces_same_keys_and_orders_buckets_as_numbers(tmp_path):
    path = tmp_path / "table.json"
    written_table(path)
    other = MoeKernelConfig(16, 64, 256, 1, 4, 5, tuned=True)
    written_table(path, moe=[((128, 2048, 768, W8A8, 16384), TILE), (MOE_KEY, other), ((128, 2048, 768, W8A8, 1), TILE)],
                  decode=[])
    table = load_table(path)
    assert table.moe[MOE_KEY] == other  # replaced
    assert table.paged_decode == {DECODE_KEY: LAUNCH}  # kept
    assert [entry["tokens"] for entry in json.loads(path.read_text())["moe"]] == [1, 256, 16384]


def test_a_new_table_starts_from_the_packaged_table_of_its_gpu_model(tmp_path):
    """A tuning run's table is whole: committed over the packaged one, it drops none of its entries."""
    written_table(tuned_configs.TABLES_DIR / "NVIDIA_H100_80GB_HBM3.json")
    other = MoeKernelConfig(16, 64, 256, 1, 4, 5, tuned=True)
    bucket_16k = (128, 2048, 768, W8A8, 16384)
    path = written_table(tmp_path / "run" / "tuned.json", moe=[(bucket_16k, other)], decode=[])
    assert load_table(path).moe == {MOE_KEY: TILE, bucket_16k: other}
    assert load_table(path).paged_decode == {DECODE_KEY: LAUNCH}
    # another GPU model, or none named, starts empty
    elsewhere = write_entries(tmp_path / "h200.json", "NVIDIA H200", moe=[moe_entry(bucket_16k, other, 0.2, None)])
    assert load_table(elsewhere).moe == {bucket_16k: other} and not load_table(elsewhere).paged_decode
    unnamed = write_entries(tmp_path / "cpu.json", None, moe=[moe_entry(bucket_16k, other, 0.2, None)])
    assert load_table(unnamed).moe == {bucket_16k: other}


def test_the_lookups_take_the_named_table_first(monkeypatch, tmp_path):
    before = lookups()
    assert before == (get_moe_config(200, 128, 2048, 768, torch.float8_e4m3fn, fp8_activations=True),
                      default_decode_config(128))
    monkeypatch.setenv(TUNED_CONFIGS_ENV_VAR, str(written_table(tmp_path / "table.json")))
    assert lookups() == (TILE, LAUNCH)
    # other keys are untouched: a bf16 expert, another bucket, another cache dtype
    assert get_moe_config(200, 128, 2048, 768, torch.bfloat16, device="cpu") == MOE_CONFIGS[(128, 2048, 768,
                                                                                              "bfloat16", 256)]
    assert get_moe_config(2000, 128, 2048, 768, torch.float8_e4m3fn, fp8_activations=True, device="cpu") != TILE
    assert get_decode_config(torch.bfloat16, 128, 200, device="cpu") == default_decode_config(128)
    # and fused_moe's own lookup reads it for these weights
    w13 = torch.empty(128, 2 * 768, 2048, dtype=torch.float8_e4m3fn)
    assert moe_gemm_config(200, w13, top_k=8, fp8_activations=True) == TILE


def test_a_table_entry_is_still_fitted_to_shared_memory(monkeypatch, tmp_path):
    """A tile measured for 2-byte weights, looked up for float32 ones (the test models on a GPU)."""
    big = MoeKernelConfig(32, 64, 128, 4, 4, 4, tuned=True)  # 245,760 B in float32
    key = (4, 64, 32, "float32", 16)
    monkeypatch.setenv(TUNED_CONFIGS_ENV_VAR, str(written_table(tmp_path / "table.json", moe=[(key, big)], decode=[])))
    assert get_moe_config(16, 4, 64, 32, torch.float32, device="cpu") == MoeKernelConfig(32, 64, 128, 4, 4, 3,
                                                                                          tuned=True)


def test_the_packaged_table_of_the_gpu_model_applies_on_that_model_only(monkeypatch, tmp_path):
    assert device_table_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert device_table_name(" NVIDIA H200 (MIG 1g.18gb) ") == "NVIDIA_H200_MIG_1g.18gb"
    written_table(tuned_configs.TABLES_DIR / "NVIDIA_H100_80GB_HBM3.json")
    # cuda:1 is another processor (an H100 PCIe has 114 SMs): not a sibling either
    on_gpus(monkeypatch, {"cpu": (None, None), "cuda:0": ("NVIDIA H100 80GB HBM3", HOPPER_132),
                          "cuda:1": ("NVIDIA H100 PCIe", Processor((9, 0), 114))})
    key = (128, 2048, 768, W8A8, 256)
    assert get_moe_config(200, *key[:3], torch.float8_e4m3fn, fp8_activations=True, device="cuda:0") == TILE
    assert get_moe_config(200, *key[:3], torch.float8_e4m3fn, fp8_activations=True, device="cuda:1") != TILE
    assert get_moe_config(200, *key[:3], torch.float8_e4m3fn, fp8_activations=True, device="cpu") != TILE
    assert get_decode_config(torch.float8_e4m3fn, 128, 256, device="cuda:0") == LAUNCH
    # a named table goes over the packaged one, entry by entry
    other = MoeKernelConfig(64, 64, 128, 1, 4, 3, tuned=True)
    monkeypatch.setenv(TUNED_CONFIGS_ENV_VAR, str(written_table(tmp_path / "mine.json", moe=[(key, other)], decode=[])))
    assert get_moe_config(200, *key[:3], torch.float8_e4m3fn, fp8_activations=True, device="cuda:0") == other
    assert get_decode_config(torch.float8_e4m3fn, 128, 256, device="cuda:0") == LAUNCH  # still the packaged one
    assert tuned_configs.tuned_configs("cuda:0").sources == (
        str(tuned_configs.TABLES_DIR / "NVIDIA_H100_80GB_HBM3.json"), str(tmp_path / "mine.json"))


def test_a_gpu_model_without_a_table_reads_its_siblings_under_its_own(monkeypatch, tmp_path):
    """An H200 has no table of its own yet: it reads the H100's (same capability, same SM count),
    and a table of its own, once tuned, goes over that one entry by entry."""
    h100_table = written_table(tuned_configs.TABLES_DIR / "NVIDIA_H100_80GB_HBM3.json")
    on_gpus(monkeypatch, {"cuda:0": ("NVIDIA H200", HOPPER_132),
                          "cuda:1": ("NVIDIA H100 PCIe", Processor((9, 0), 114)),
                          "cuda:2": ("NVIDIA A100-SXM4-80GB", Processor((8, 0), 132))})
    fp8_tile = (200, 128, 2048, 768, torch.float8_e4m3fn)
    assert get_moe_config(*fp8_tile, fp8_activations=True, device="cuda:0") == TILE
    assert get_decode_config(torch.float8_e4m3fn, 128, 256, device="cuda:0") == LAUNCH
    assert tuned_configs.tuned_configs("cuda:0").sources == (str(h100_table),)
    assert tuned_configs.describe_sources((str(h100_table),), "NVIDIA H200") == (
        f"{h100_table} (a sibling GPU model's: the same compute capability and SM count)")
    assert tuned_configs.describe_sources((str(h100_table),), "NVIDIA H100 80GB HBM3") == str(h100_table)
    for other in ("cuda:1", "cuda:2"):  # fewer SMs, or another architecture: the built-in tables
        assert get_moe_config(*fp8_tile, fp8_activations=True, device=other) != TILE
        assert get_decode_config(torch.float8_e4m3fn, 128, 256, device=other) == default_decode_config(128)
        assert tuned_configs.tuned_configs(other).sources == ()

    # the H200's own table, MoE tiles only: its tile wins, the decode setting is still the sibling's
    own = MoeKernelConfig(64, 64, 128, 1, 4, 3, tuned=True)
    h200_table = written_table(tuned_configs.TABLES_DIR / "NVIDIA_H200.json", moe=[(MOE_KEY, own)], decode=[],
                               device="NVIDIA H200")
    tuned_configs.clear_cache()
    assert get_moe_config(*fp8_tile, fp8_activations=True, device="cuda:0") == own
    assert get_decode_config(torch.float8_e4m3fn, 128, 256, device="cuda:0") == LAUNCH
    assert tuned_configs.tuned_configs("cuda:0").sources == (str(h100_table), str(h200_table))
    # and the H200's table is now the H100's sibling, under the H100's own
    on_gpus(monkeypatch, {"cuda:0": ("NVIDIA H100 80GB HBM3", HOPPER_132)})
    assert get_moe_config(*fp8_tile, fp8_activations=True, device="cuda:0") == TILE
    assert tuned_configs.tuned_configs("cuda:0").sources == (str(h200_table), str(h100_table))


@pytest.mark.gpu
def test_on_a_gpu_its_processor_is_read_and_an_h100_sxm_or_h200_reads_the_h100_table(monkeypatch):
    """The processor comes from the device's properties; on sm_90 with 132 SMs (an H100 SXM, an
    H200) the packaged H100 table is in effect, its own or a sibling's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(tuned_configs, "TABLES_DIR", PACKAGED_DIR)
    tuned_configs.clear_cache()
    properties = torch.cuda.get_device_properties(0)
    processor = tuned_configs.device_processor("cuda")
    assert processor == Processor((properties.major, properties.minor), properties.multi_processor_count)
    if processor != HOPPER_132:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is {processor}, not sm_90 with 132 SMs")
    assert str(PACKAGED_DIR / "NVIDIA_H100_80GB_HBM3.json") in tuned_configs.tuned_configs("cuda").sources


def test_a_table_that_does_not_declare_its_processor_is_nobodys_sibling(monkeypatch):
    path = written_table(tuned_configs.TABLES_DIR / "NVIDIA_H100_80GB_HBM3.json", processor=None)
    assert "multiprocessors" not in json.loads(path.read_text())
    on_gpus(monkeypatch, {"cuda:0": ("NVIDIA H200", HOPPER_132), "cuda:1": ("NVIDIA H100 80GB HBM3", HOPPER_132)})
    assert tuned_configs.tuned_configs("cuda:0").sources == ()
    assert tuned_configs.tuned_configs("cuda:1").sources == (str(path),)  # still its own model's table
    for broken in ({"compute_capability": [9], "multiprocessors": 132},
                   {"compute_capability": [9, 0], "multiprocessors": "132"},
                   {"compute_capability": [True, 0], "multiprocessors": 132}):
        assert Processor.of_table(broken) is None
    assert Processor.of_table(HOPPER_132.fields()) == HOPPER_132


def test_a_written_table_declares_the_processor_it_was_measured_on(tmp_path):
    document = json.loads(written_table(tmp_path / "table.json").read_text())
    assert (document["device"], document["compute_capability"], document["multiprocessors"]) == (
        "NVIDIA H100 80GB HBM3", [9, 0], 132)
    assert Processor.of_table(document) == HOPPER_132


def test_a_named_table_that_is_missing_is_an_error_naming_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv(TUNED_CONFIGS_ENV_VAR, str(tmp_path / "nowhere.json"))
    with pytest.raises(TunedTableError, match=f"{TUNED_CONFIGS_ENV_VAR}=.*nowhere.json: no such file"):
        lookups()


@pytest.mark.parametrize(("document", "message"), [
    ("{not json", "not JSON"),
    ('{"moe": []}', "not a table of format 1"),
    ('{"format": 1, "moe": {}}', "'moe' is not a list"),
    ('{"format": 1, "moe": [3]}', "moe entry 0: not an object"),
    ('{"format": 1, "moe": [{"num_experts": 128, "hidden": 2048, "dtype": "bfloat16", "tokens": 1, "config": {}}]}',
     "moe entry 0: missing intermediate"),
    ('{"format": 1, "moe": [{"num_experts": 128, "hidden": 2048, "intermediate": 768, "dtype": "bf16", '
     '"tokens": 1, "config": {}}]}', "dtype='bf16' is not one of"),
    ('{"format": 1, "moe": [{"num_experts": 128, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16", '
     '"tokens": 300, "config": {}}]}', "tokens=300 is not a token bucket"),
    ('{"format": 1, "moe": [{"num_experts": 0, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16", '
     '"tokens": 1, "config": {}}]}', "num_experts=0 is not a positive integer"),
    ('{"format": 1, "moe": [{"num_experts": 128, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16", '
     '"tokens": 1, "config": {"block_size_m": 16, "blok_size_n": 64}}]}', "unknown fields \\['blok_size_n'\\]"),
    ('{"format": 1, "moe": [{"num_experts": 128, "hidden": 2048, "intermediate": 768, "dtype": "bfloat16", '
     '"tokens": 1, "config": {"block_size_m": 16}}]}', "moe entry 0: config: .*missing"),
    ('{"format": 1, "paged_decode": [{"kv_dtype": "float8_e4m3fn", "head_dim": 128, "batch": 256, '
     '"config": {"block_n": -64}}]}', "paged_decode entry 0: config block_n=-64 is not a positive integer"),
    ('{"format": 1, "paged_decode": [{"kv_dtype": "int8", "head_dim": 128, "batch": 256, "config": {}}]}',
     "kv_dtype='int8' is not one of"),
    ('{"format": 1, "paged_decode": [{"kv_dtype": "bfloat16", "head_dim": 128, "batch": 100, "config": {}}]}',
     "batch=100 is not a batch bucket"),
])
def test_a_broken_table_is_an_error_naming_the_file_and_the_entry(monkeypatch, tmp_path, document, message):
    path = tmp_path / "broken.json"
    path.write_text(document)
    monkeypatch.setenv(TUNED_CONFIGS_ENV_VAR, str(path))
    with pytest.raises(TunedTableError, match=message) as raised:
        lookups()
    assert str(path) in str(raised.value)


@pytest.mark.parametrize("path", sorted(PACKAGED_DIR.glob("*.json")), ids=lambda path: path.name)
def test_every_packaged_table_reads_and_is_named_after_its_gpu_model(path):
    """A table committed from a GPU session: it loads, and its file is the one its GPU model looks up."""
    table = load_table(path)
    assert table.moe or table.paged_decode
    document = json.loads(path.read_text())
    assert path.name == device_table_path(document["device"]).name
    assert Processor.of_table(document) is not None  # so that its GPU model's siblings read it


def test_writing_a_bad_entry_leaves_the_table_as_it_was(tmp_path):
    path = written_table(tmp_path / "table.json")
    before = path.read_text()
    bad = {**moe_entry(MOE_KEY, TILE, 0.1, None), "tokens": 300}
    with pytest.raises(TunedTableError, match="tokens=300"):
        write_entries(path, None, moe=[bad])
    assert path.read_text() == before and not (tmp_path / "table.json.tmp").exists()
    assert load_table(path).moe == {MOE_KEY: TILE}
