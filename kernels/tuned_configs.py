"""Launch settings measured on one GPU model, kept as JSON tables read at run time.

The fused MoE's tiles (`kernels/moe/configs.py`) and the paged decode attention's
launch settings (`kernels/paged_decode_configs.py`) each have a built-in table. The
best settings differ between GPUs (an H100 and an H200 have the same SMs but not the
same memory bandwidth), and a table written into Python needs a commit before an
engine can use it. So the tuners (`scripts/bench_kernels.py --tune-moe | --tune-decode
--write-table PATH`) write what they measure into a JSON table, and the lookups read,
highest precedence first:

1. the table named by ``VLM_CATALOG_TUNED_CONFIGS`` (a file path), on every device: a
   user's own tuning, or one just written in the same device call;
2. the packaged table of the running GPU model, ``kernels/tuned/<device name>.json``
   (`device_table_path`: the name torch reports, spaces as underscores), on CUDA only;
3. the packaged tables of its siblings: other GPU models with the same compute capability
   and the same number of SMs (an H200 and an H100 SXM: sm_90, 132 SMs), as the tables
   declare them (`Processor`). Their tiles fit the same SMs and the same shared memory, and
   were measured under the engine's conditions, which the built-in tables were not; a
   model's own table goes over them entry by entry;
4. the built-in Python tables, then the heuristics.

A table is read once per process (per device name and file path). A table that cannot
be read, or an entry that is not a valid key or config, is an error naming the file and
the entry: a wrong table never runs silently.

The format (``format`` 1), one list per kernel, each entry with its key, its config and
what the tuner measured (``ms``, and ``default_ms``: the setting it replaced, on the
same inputs)::

    {"format": 1, "device": "NVIDIA H100 80GB HBM3",
     "compute_capability": [9, 0], "multiprocessors": 132,
     "moe": [{"num_experts": 128, "hidden": 2048, "intermediate": 768,
              "dtype": "float8_e4m3fn_w8a8", "tokens": 256,
              "config": {"block_size_m": 32, ...}, "ms": 0.21, "default_ms": 0.46,
              "date": "2026-11-28", "versions": {"torch": "...", "triton": "..."}}],
     "paged_decode": [{"kv_dtype": "float8_e4m3fn", "head_dim": 128, "batch": 256,
                       "config": {"block_n": 64, ...}, "ms": ..., "default_ms": ...}]}
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

TUNED_CONFIGS_ENV_VAR = "VLM_CATALOG_TUNED_CONFIGS"
TABLES_DIR = Path(__file__).resolve().parent / "tuned"
FORMAT = 1
MOE_KEY_FIELDS = ("num_experts", "hidden", "intermediate", "dtype", "tokens")
DECODE_KEY_FIELDS = ("kv_dtype", "head_dim", "batch")
KINDS = {"moe": MOE_KEY_FIELDS, "paged_decode": DECODE_KEY_FIELDS}


class TunedTableError(ValueError):
    """A tuned table that cannot be used: the message names the file and the entry."""


@dataclass(frozen=True)
class TunedConfigs:
    """The entries in effect on one device: MoE tiles keyed as `kernels.moe.configs.MOE_CONFIGS`
    (num_experts, hidden, intermediate, table dtype, token bucket), decode launch settings as
    `kernels.paged_decode_configs.DECODE_CONFIGS` (KV dtype name, head_dim, batch bucket), and the
    files they came from (lowest precedence first)."""

    moe: Mapping[tuple, Any] = field(default_factory=dict)
    paged_decode: Mapping[tuple, Any] = field(default_factory=dict)
    sources: tuple[str, ...] = ()


NO_TUNED_CONFIGS = TunedConfigs()


@dataclass(frozen=True)
class Processor:
    """What a GPU model's tiles depend on besides its memory: its compute capability and its SM
    count. A table records the processor it was measured on (``compute_capability``,
    ``multiprocessors``); models with the same one read each other's tables (the lookup order
    above)."""

    capability: tuple[int, int]
    multiprocessors: int

    def fields(self) -> dict[str, Any]:
        return {"compute_capability": list(self.capability), "multiprocessors": self.multiprocessors}

    @classmethod
    def of_table(cls, document: Mapping[str, Any]) -> Processor | None:
        """The processor a table declares, or None (a table from before the fields, or a
        malformed one: such a table is nobody's sibling)."""
        capability, multiprocessors = document.get("compute_capability"), document.get("multiprocessors")
        if (not isinstance(capability, list) or len(capability) != 2
                or not all(isinstance(part, int) and not isinstance(part, bool) for part in capability)
                or not isinstance(multiprocessors, int) or isinstance(multiprocessors, bool)):
            return None
        return cls((capability[0], capability[1]), multiprocessors)


def device_table_name(device_name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'NVIDIA_H100_80GB_HBM3' (a file name on any system)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", device_name.strip()).strip("_")


def device_table_path(device_name: str) -> Path:
    """The packaged table of a GPU model."""
    return TABLES_DIR / f"{device_table_name(device_name)}.json"


@functools.cache
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def _cuda_processor(index: int) -> Processor:
    properties = torch.cuda.get_device_properties(index)
    return Processor((properties.major, properties.minor), properties.multi_processor_count)


def _cuda_index(device: torch.device | str | None) -> int | None:
    if device is None:
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device.index if device.index is not None else torch.cuda.current_device()


def device_name(device: torch.device | str | None) -> str | None:
    """The GPU model a CUDA device is (None for any other device)."""
    index = _cuda_index(device)
    return None if index is None else _cuda_device_name(index)


def device_processor(device: torch.device | str | None) -> Processor | None:
    """A CUDA device's compute capability and SM count (None for any other device)."""
    index = _cuda_index(device)
    return None if index is None else _cuda_processor(index)


def tuned_configs(device: torch.device | str | None) -> TunedConfigs:
    """The tuned entries in effect for `device` (its siblings' packaged tables, then its GPU
    model's own, then the one ``VLM_CATALOG_TUNED_CONFIGS`` names over them); empty where there
    are none."""
    override = os.environ.get(TUNED_CONFIGS_ENV_VAR, "").strip()
    name = device_name(device)
    return _merged(name, device_processor(device) if name is not None else None, override)


def sibling_tables(name: str, processor: Processor | None) -> list[Path]:
    """The packaged tables of other GPU models with `processor` (in file-name order)."""
    if processor is None or not TABLES_DIR.is_dir():
        return []
    own = device_table_path(name)
    return [path for path in sorted(TABLES_DIR.glob("*.json"))
            if path.name != own.name and Processor.of_table(_read(path)) == processor]


def is_siblings_table(source: str, name: str | None) -> bool:
    """Whether the table at `source` is a packaged table (in a folder named as `TABLES_DIR`, so
    also in a record made on another machine) of another GPU model than `name`: a sibling's."""
    path = Path(source)
    return name is not None and path.parent.name == TABLES_DIR.name and path.stem != device_table_name(name)


def describe_sources(sources: Iterable[str], name: str | None) -> str:
    """`TunedConfigs.sources` for a log line, a sibling's packaged table marked as such."""
    return ", ".join(f"{source} (a sibling GPU model's: the same compute capability and SM count)"
                     if is_siblings_table(source, name) else source for source in sources)


@functools.cache
def _merged(name: str | None, processor: Processor | None, override: str) -> TunedConfigs:
    tables = []
    if name is not None:
        tables += sibling_tables(name, processor)
        if device_table_path(name).is_file():
            tables.append(device_table_path(name))
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise TunedTableError(f"{TUNED_CONFIGS_ENV_VAR}={override}: no such file")
        tables.append(path)
    if not tables:
        return NO_TUNED_CONFIGS
    moe, decode = {}, {}
    for path in tables:
        table = load_table(path)
        moe.update(table.moe)
        decode.update(table.paged_decode)
    return TunedConfigs(moe, decode, tuple(str(path) for path in tables))


def clear_cache() -> None:
    """Forget the tables read so far (after one was written in this process)."""
    _merged.cache_clear()


def load_table(path: Path) -> TunedConfigs:
    """Every entry of one table file, checked (`TunedTableError` names what is wrong)."""
    document = _read(path)
    return TunedConfigs(
        {_moe_key(entry, path, index): _config(entry, "moe", path, index)
         for index, entry in enumerate(document.get("moe", []))},
        {_decode_key(entry, path, index): _config(entry, "paged_decode", path, index)
         for index, entry in enumerate(document.get("paged_decode", []))},
        (str(path),),
    )


def _read(path: Path) -> dict:
    try:
        document = json.loads(Path(path).read_text())
    except OSError as error:
        raise TunedTableError(f"tuned table {path}: cannot be read ({error})") from error
    except json.JSONDecodeError as error:
        raise TunedTableError(f"tuned table {path}: not JSON ({error})") from error
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise TunedTableError(f"tuned table {path}: not a table of format {FORMAT} "
                              f"(an object with \"format\": {FORMAT})")
    for kind in KINDS:
        if not isinstance(document.get(kind, []), list):
            raise TunedTableError(f"tuned table {path}: {kind!r} is not a list of entries")
    return document


def _entry_error(path: Path, kind: str, index: int, problem: str) -> TunedTableError:
    return TunedTableError(f"tuned table {path}: {kind} entry {index}: {problem}")


def _checked_fields(entry: Any, kind: str, path: Path, index: int) -> dict:
    if not isinstance(entry, dict):
        raise _entry_error(path, kind, index, "not an object")
    missing = [name for name in (*KINDS[kind], "config") if name not in entry]
    if missing:
        raise _entry_error(path, kind, index, f"missing {', '.join(missing)}")
    return entry


def _positive_int(entry: dict, name: str, kind: str, path: Path, index: int) -> int:
    value = entry[name]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise _entry_error(path, kind, index, f"{name}={value!r} is not a positive integer")
    return value


def _moe_key(entry: Any, path: Path, index: int) -> tuple:
    from kernels.moe.configs import TOKEN_BUCKETS, table_dtypes

    entry = _checked_fields(entry, "moe", path, index)
    sizes = [_positive_int(entry, name, "moe", path, index) for name in ("num_experts", "hidden", "intermediate")]
    if entry["dtype"] not in table_dtypes():
        raise _entry_error(path, "moe", index, f"dtype={entry['dtype']!r} is not one of {', '.join(table_dtypes())}")
    if entry["tokens"] not in TOKEN_BUCKETS:
        raise _entry_error(path, "moe", index, f"tokens={entry['tokens']!r} is not a token bucket {TOKEN_BUCKETS}")
    return (*sizes, entry["dtype"], entry["tokens"])


def _decode_key(entry: Any, path: Path, index: int) -> tuple:
    from kernels.paged_decode_configs import DECODE_BATCH_BUCKETS, KV_DTYPES

    entry = _checked_fields(entry, "paged_decode", path, index)
    if entry["kv_dtype"] not in KV_DTYPES:
        raise _entry_error(path, "paged_decode", index,
                           f"kv_dtype={entry['kv_dtype']!r} is not one of {', '.join(KV_DTYPES)}")
    head_dim = _positive_int(entry, "head_dim", "paged_decode", path, index)
    if entry["batch"] not in DECODE_BATCH_BUCKETS:
        raise _entry_error(path, "paged_decode", index,
                           f"batch={entry['batch']!r} is not a batch bucket {DECODE_BATCH_BUCKETS}")
    return entry["kv_dtype"], head_dim, entry["batch"]


def _config_class(kind: str) -> type:
    if kind == "moe":
        from kernels.moe.configs import MoeKernelConfig

        return MoeKernelConfig
    from kernels.paged_decode_configs import DecodeKernelConfig

    return DecodeKernelConfig


def _config(entry: dict, kind: str, path: Path, index: int):
    """The entry's config: the dataclass's fields (`tuned` defaults to True: a table holds
    measured settings), each a positive integer."""
    config_class = _config_class(kind)
    values = entry["config"]
    if not isinstance(values, dict):
        raise _entry_error(path, kind, index, "config is not an object")
    names = {item.name for item in fields(config_class)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise _entry_error(path, kind, index, f"config has unknown fields {unknown} (known: {sorted(names)})")
    values = {"tuned": True, **values}
    for name, value in values.items():
        if name == "tuned":
            if not isinstance(value, bool):
                raise _entry_error(path, kind, index, f"config tuned={value!r} is not true or false")
        elif not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise _entry_error(path, kind, index, f"config {name}={value!r} is not a positive integer")
    try:
        return config_class(**values)
    except TypeError as error:  # a required field missing
        raise _entry_error(path, kind, index, f"config: {error}") from error


# --------------------------------------------------------------------------- writing (the tuners)
def moe_entry(key: tuple, config, ms: float, default_ms: float | None) -> dict:
    """A table entry for one MoE tile (key as in MOE_CONFIGS) and what the tuner measured."""
    return {**dict(zip(MOE_KEY_FIELDS, key, strict=True)), **_measured(config, ms, default_ms)}


def decode_entry(key: tuple, config, ms: float, default_ms: float | None) -> dict:
    """A table entry for one decode launch setting (key as in DECODE_CONFIGS)."""
    return {**dict(zip(DECODE_KEY_FIELDS, key, strict=True)), **_measured(config, ms, default_ms)}


def _measured(config, ms: float, default_ms: float | None) -> dict:
    return {"config": asdict(config), "ms": round(ms, 5),
            "default_ms": None if default_ms is None else round(default_ms, 5),
            "date": datetime.date.today().isoformat(), "versions": _versions()}


def _sort_key(entry: dict, key_fields: tuple[str, ...]) -> tuple:
    """Entries in key order, numbers as numbers (token bucket 256 before 4096)."""
    return tuple((0, value, "") if isinstance(value, int) else (1, 0, str(value))
                 for value in (entry[name] for name in key_fields))


def _versions() -> dict[str, str | None]:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"torch": torch.__version__, "triton": triton_version}


def write_entries(path: Path, device: str | None, *, moe: Iterable[dict] = (),
                  paged_decode: Iterable[dict] = (), processor: Processor | None = None) -> Path:
    """Merges entries into the table at `path` (an entry with the key of one already there
    replaces it), checks the result as a reader would, and writes it whole (a reader never sees
    half a file). `device`: the GPU model it was measured on, and `processor` its capability and
    SM count (`device_processor`), which let its siblings read the table. A new table starts
    from that model's own packaged one where there is one (never a sibling's: its entries were
    not measured here), so a tuning run's table is whole: committed over the packaged file, it
    drops none of its entries."""
    path = Path(path)
    if path.exists():
        document = _read(path)
    elif device is not None and device_table_path(device).is_file():
        document = _read(device_table_path(device))
    else:
        document = {"format": FORMAT, "moe": [], "paged_decode": []}
    if device is not None:
        document["device"] = device
    if processor is not None:
        document.update(processor.fields())
    for kind, new in (("moe", list(moe)), ("paged_decode", list(paged_decode))):
        key_fields = KINDS[kind]
        merged = {tuple(entry.get(name) for name in key_fields): entry for entry in document.get(kind, [])}
        merged.update({tuple(entry[name] for name in key_fields): entry for entry in new})
        document[kind] = sorted(merged.values(), key=lambda entry: _sort_key(entry, key_fields))
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".tmp")
    staging.write_text(json.dumps(document, indent=1) + "\n")
    try:
        load_table(staging)
    except TunedTableError:
        staging.unlink()
        raise
    os.replace(staging, path)
    clear_cache()
    return path
