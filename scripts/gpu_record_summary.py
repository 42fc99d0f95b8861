#!/usr/bin/env python
"""Issue 9's numbers out of a GPU record: what `bench_gpu.py --json` (and the `decode` plan's
files) wrote, as the Markdown tables docs/benchmarks.md keeps.

    python scripts/gpu_record_summary.py docs/results/gpu/bench_gpu.json
    python scripts/gpu_record_summary.py $OUT/bench_gpu.json --previous docs/results/gpu/bench_gpu.json
    python scripts/gpu_record_summary.py $OUT/bench_gpu.json --extra $OUT/engine_fast.json \\
        --attention $OUT/attention.json $OUT/attention_bf16_dots.json
    python scripts/gpu_record_summary.py $OUT/engine_tuned.json --tuned $OUT/tuned_configs.json

Sections (each only where the record has its phase): the engine runs (samples/s, tokens/s,
steps, and where their seconds went on the device: `device_seconds`), the profiled run's
device time by region and kind of kernel (`engine_profile`), constrained decoding and the
grammars' host time, the roofline with the decode step's largest kernels, the vision
encoder, and the kernel rows with a target or a switch to set (decode attention, the MoE's
grouped GEMMs, cuDNN attention). `--previous`: a column of an older record beside each
engine and target number. `--tuned`: a tuned table the tuners wrote (kernels/tuned_configs.py),
each entry's time against the setting it replaced. Records from before a field existed print
"-" for it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ENGINE_PHASES = ("engine", "engine_fp8_kv", "engine_fp8", "engine_w8a8", "engine_w8a8_channel",
                 "engine_w8a8_channel_grouped_mm", "engine_w8a8_channel_fast", "engine_w8a8_channel_fa3",
                 "engine_w8a8_channel_fa2", "engine_w8a8_channel_tuned", "engine_profile")
# kernel rows worth a line: their names start with one of these
# the rows that set a switch or a default: decode attention, the MoE's GEMM choice, and every
# vision attention row (our kernel, SDPA with cuDNN, FlashAttention's varlen)
KERNEL_ROW_PREFIXES = ("paged_decode_attention", "paged_prefill_attention", "fused_moe[grouped_mm]", "fused_moe[fp8 w8a8, per-channel",
                       "varlen_attention", "moe_align_block_size", "fused_sum_add_rms_norm[FP8 out]")
UNMARKED_REGION = "unmarked"  # vlm_catalog.bench.device_profile.UNMARKED (this script imports no project code)
PROFILE_REGIONS = ("vlm.vision_encoder", "vlm.text_forward.prefill", "vlm.text_forward.decode", "vlm.step",
                   UNMARKED_REGION)
KINDS = ("attention", "moe", "gemm", "norm_rotary", "quantize", "copy", "other")


def number(value, digits: int = 2, unit: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:,.{digits}f}{unit}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def engine_runs(record: dict) -> dict[str, dict]:
    """{phase (run): the run's summary} for every engine run in the record."""
    runs = {}
    for phase, result in record.items():  # a phase, or "phase (file)" from another file of the session
        if phase.split(" (")[0] not in ENGINE_PHASES or not isinstance(result, dict):
            continue
        if "error" in result:
            runs[phase] = {"error": result["error"]}
        if isinstance(result.get("fixed_150_tokens"), dict):
            runs[phase] = result["fixed_150_tokens"]
        for number_, again in enumerate(result.get("fixed_150_tokens_again") or (), start=2):  # --repeat-runs
            if isinstance(again, dict):
                runs[f"{phase} (run {number_})"] = again
    for phase in CONSTRAINED_PHASES:
        if isinstance(record.get(phase), dict):
            for run in ("constrained_real_stop", "unconstrained_same_tokens", "constrained_again"):
                if isinstance(record[phase].get(run), dict):
                    runs[f"{phase} ({run})"] = record[phase][run]
    return runs


def engine_section(record: dict, previous: dict | None) -> str:
    runs, before = engine_runs(record), engine_runs(previous or {})
    rows = []
    for name, run in runs.items():
        if "error" in run:
            rows.append([name, f"error: {run['error'][:80]}"] + ["-"] * 8)
            continue
        split = run.get("device_seconds", {})
        host = run.get("host_forward_seconds", {})
        rows.append([
            name,
            number(run.get("samples_per_s")) + (f" (was {number(before[name].get('samples_per_s'))})"
                                                if name in before and "samples_per_s" in before[name] else ""),
            number(run.get("seconds")),
            number(run.get("prefill_tokens_per_s"), 0),
            number(run.get("decode_tokens_per_s"), 0),
            str(run.get("model_steps", "-")) + (f" ({run['prefill_steps']} prefill)" if "prefill_steps" in run else ""),
            number(split.get("vision_encoder", run.get("vision_encoder_seconds"))),
            " / ".join(number(split.get(part)) for part in ("text_forward_prefill_steps", "text_forward_decode_steps")),
            " / ".join(number(split.get(part)) for part in ("rest_of_steps", "between_steps")),
            " / ".join(number(host.get(part)) for part in ("prefill_steps", "decode_steps")) if host else "-",
        ])
    header = ["run", "samples/s", "seconds", "prefill tok/s", "decode tok/s", "steps", "vision s",
              "text forward s (prefill / decode steps)", "rest of steps / between steps s",
              "host s in the text forward (prefill / decode steps)"]
    tables = [f"{phase}: {', '.join(table_label(source, record.get('device')) for source in result['tuned_configs'])}"
              for phase, result in record.items()
              if phase.split(" (")[0] in ENGINE_PHASES and isinstance(result, dict) and result.get("tuned_configs")]
    read = f"\n\ntuned tables read: {'; '.join(tables)}" if tables else ""
    paid = [f"- {name}: {line}" for name, run in runs.items() if (line := diagnostics_line(run.get("diagnostics")))]
    paid_text = "\n\nwhat each run paid for besides its work:\n" + "\n".join(paid) if paid else ""
    hosts = [f"- {name}: {line}" for name, run in runs.items() if (line := host_line(run))]
    host_text = ("\n\nthe host's time in the engine's steps (working about as long as the device means "
                 "the device waited for it):\n" + "\n".join(hosts)) if hosts else ""
    routed = [f"- {phase}: {line}" for phase, result in record.items()
              if phase.split(" (")[0] in ENGINE_PHASES and isinstance(result, dict)
              and (line := routing_line(result.get("routing")))]
    routed_text = "\n\nhow spread the routing was (an untimed pass after the timed runs):\n" + "\n".join(routed) if routed else ""
    return "## Engine runs\n\n" + table(header, rows) + read + paid_text + host_text + routed_text


def routing_line(routing: dict | None) -> str | None:
    """A phase's `routing` (bench/routing_stats.py) in one line: the busiest k experts' share of
    the expert slots in prefill-sized router calls, and the experts decode-sized calls touched,
    each beside what uniform routing gives."""
    if not isinstance(routing, dict):
        return None
    if "error" in routing:
        return f"the routing pass failed: {routing['error']}"
    parts = []
    large, small = routing.get("large_calls"), routing.get("small_calls")
    k = routing.get("top_k")
    if large:
        parts.append(f"the busiest {k} experts took {large['top_k_share']:.0%} of the slots "
                     f"({large['top_k_share_worst_layer']:.0%} at the worst layer; uniform "
                     f"{routing['uniform_top_k_share']:.0%}) in {large['calls']} prefill-sized calls, "
                     f"busiest / mean load {number(large['max_over_mean_load'], 1)}, "
                     f"{large['experts_unused']} layer-experts unused")
    if small:
        parts.append(f"decode-sized calls touched {number(small['distinct_experts'], 1)} experts per layer "
                     f"(uniform {number(small['uniform_distinct_experts'], 1)})")
    return "; ".join(parts) or None


def diagnostics_line(diagnostics: dict | None) -> str | None:
    """A run's `diagnostics` (bench/run_diagnostics.py) in one line: the Triton variants first
    launched in it (the costliest three named), Python's collections, the allocator's calls."""
    if not isinstance(diagnostics, dict):
        return None
    parts = []
    variants = diagnostics.get("triton_variants")
    if variants is None:
        parts.append("Triton variants not counted")
    else:
        costly = sorted(variants.items(), key=lambda item: -item[1]["seconds"])[:3]
        named = ", ".join(f"{name} x{v['count']} {number(v['seconds'])} s" for name, v in costly)
        parts.append(f"{sum(v['count'] for v in variants.values())} Triton variants first launched, "
                     f"{number(diagnostics.get('triton_variant_seconds'))} s" + (f" ({named})" if named else ""))
    collected = diagnostics.get("gc", {})
    parts.append(f"{sum(collected.get('collections', {}).values())} collections {number(collected.get('seconds'))} s")
    allocator = diagnostics.get("cuda_allocator")
    if allocator:
        parts.append(f"cudaMalloc {allocator['num_device_alloc']}, cudaFree {allocator['num_device_free']}, "
                     f"retries after an OOM {allocator['num_alloc_retries']}")
        if "num_host_alloc" in allocator:
            parts.append(f"{allocator['num_host_alloc']} pinned blocks, {number(allocator.get('host_alloc_seconds'))} s")
    return "; ".join(parts)


def host_line(run: dict) -> str | None:
    """A run's `host_seconds` (bench_gpu.py's `host_time_split`) against the device's time in
    steps, in one line; None for a record from before the split."""
    host, device = run.get("host_seconds"), run.get("device_seconds", {})
    if not isinstance(host, dict):
        return None
    in_steps = sum(device.get(part) or 0.0 for part in ("vision_encoder", "text_forward_prefill_steps",
                                                        "text_forward_decode_steps", "rest_of_steps"))
    waiting = host.get("waiting_for_sampled_tokens") or {}
    return (f"working {number(host.get('working'))} s (scheduling {number(host.get('scheduling'))}, steps "
            f"{number(host.get('steps'))} less their waits for sampled tokens, "
            f"{number(waiting.get('prefill_steps'))} in prefill and {number(waiting.get('decode_steps'))} in "
            f"decode steps, outputs {number(host.get('outputs'))}) against the device's {number(in_steps)} s "
            "in steps")


def table_label(source: str, device: str | None) -> str:
    """A tuned table's file name; a packaged table of another GPU model than the record's is a
    sibling's (kernels/tuned_configs.py: the same compute capability and SM count)."""
    from kernels.tuned_configs import is_siblings_table

    name = Path(source).name
    return f"{name} (a sibling's, on this {device})" if is_siblings_table(source, device) else name


def tuned_section(label: str, tuned: dict) -> str:
    """A tuned table's entries: the kernel, its key, the config, its time against the setting in
    effect before it (both measured by the tuner on the same inputs)."""
    rows = []
    for kind, key_fields in (("moe", ("dtype", "tokens")), ("paged_decode", ("kv_dtype", "batch"))):
        for entry in tuned.get(kind, []):
            config = entry.get("config", {})
            ms, default_ms = entry.get("ms"), entry.get("default_ms")
            rows.append([kind, " ".join(f"{name}={entry.get(name)}" for name in key_fields),
                         " ".join(f"{value}" for name, value in config.items() if name != "tuned"),
                         number(ms, 4), number(default_ms, 4),
                         number(default_ms / ms if ms and default_ms else None)])
    header = ["kernel", "key", "config", "ms", "ms before", "speed-up"]
    return f"## Tuned table {label} ({tuned.get('device', '?')})\n\n" + table(header, rows)


def profile_section(record: dict) -> str | None:
    profile = record.get("engine_profile", {}).get("profile")
    if not isinstance(profile, dict):
        return None
    if "error" in profile:
        return f"## Profiled run\n\nerror: {profile['error']}"
    regions = profile.get("regions", {})
    rows = []
    for region in [*PROFILE_REGIONS, *sorted(set(regions) - set(PROFILE_REGIONS))]:
        if region in regions:
            kinds = regions[region]["kinds"]
            rows.append([region, number(regions[region]["seconds"], 3)] + [number(kinds.get(k), 3) for k in KINDS]
                        + [number(regions[region].get("idle_seconds"), 3)])
    text = (f"## Profiled run ({profile.get('time')})\n\n"
            f"busy {number(profile.get('busy_seconds'))} s of {number(profile.get('wall_seconds'))} s "
            f"({number(100 * (profile.get('busy_fraction') or math.nan), 0)}%), kernels "
            f"{number(profile.get('kernel_seconds'))} s"
            + (f" ({number(profile['unlinked_kernel_seconds'])} s of them linked to no host event, charged by the "
               "marks on the device's timeline)" if profile.get("unlinked_kernel_seconds") is not None else "")
            + "\n\n")
    # idle: the device ran nothing, inside the region's marks (a record before 2026-11-28's last
    # sessions has no such field: "-")
    text += table(["region", "seconds", *KINDS, "idle"], rows)
    for region in ("vlm.text_forward.prefill", "vlm.text_forward.decode", UNMARKED_REGION):
        top = regions.get(region, {}).get("top", [])[:6]
        if top:
            text += f"\n\nlargest in {region}:\n" + "\n".join(
                f"- {number(row['seconds'], 3)} s, {row['calls']} calls: `{row['name'][:100]}`" for row in top)
    for region in [*PROFILE_REGIONS, *sorted(set(regions) - set(PROFILE_REGIONS))]:
        waits = regions.get(region, {}).get("waits", [])[:5]
        if waits:
            text += f"\n\nlongest waits for the host in {region} (kernel before -> host op -> kernel after):\n" + "\n".join(
                f"- {number(wait['seconds'], 3)} s, {wait['count']} gaps: `{wait['before'][:60]}` -> "
                f"{wait['launched_by'] or '(no host link)'} -> `{wait['after'][:60]}`" for wait in waits)
    return text


CONSTRAINED_PHASES = {"constrained": "bf16 model", "constrained_w8a8_channel": "per-channel W8A8, FP8 KV cache"}


def constrained_section(record: dict, previous: dict | None) -> str | None:
    parts = [constrained_lines(record, previous, phase, label) for phase, label in CONSTRAINED_PHASES.items()]
    parts = [part for part in parts if part]
    return "## Constrained decoding\n\n" + "\n".join(parts) if parts else None


def constrained_lines(record: dict, previous: dict | None, phase: str, label: str) -> str | None:
    result = record.get(phase)
    if not isinstance(result, dict) or "error" in result:
        return None
    ratio = result.get("constrained_over_unconstrained")
    was = (previous or {}).get(phase, {}).get("constrained_over_unconstrained")
    run = result.get("constrained_real_stop", {})
    again = result.get("constrained_again_over_unconstrained")  # --repeat-runs 2: timed again, after
    lines = [f"{phase} ({label}, KV cache {result.get('kv_cache_tokens', '-')} tokens): constrained / "
             f"unconstrained at equal tokens: {number(ratio)}x"
             + (f" (was {number(was)}x)" if was else "") + " (target 0.95x)"
             + (f"; the constrained run again, after the unconstrained one: {number(again)}x"
                if again is not None else ""),
             f"grammar compilations: {result.get('grammar_compilations', '-')} in "
             f"{number(result.get('grammar_compile_seconds'))} s; mean wait before scheduling "
             f"{number(run.get('grammar_wait_seconds_mean'), 3)} s",
             f"host: masks filled {number(run.get('grammar_fill_seconds'))} s, grammars advanced "
             f"{number(run.get('grammar_advance_seconds'))} s, masks applied {number(run.get('logit_masking_seconds'))} s"]
    other = result.get("other_jump_forward")  # --repeat-runs 2: the constrained run with jump-forward the other way
    if isinstance(other, dict) and isinstance(other.get("run"), dict):
        lines.append(f"with jump-forward {'on' if other.get('jump_forward') else 'off'}: "
                     f"{number(other['run'].get('samples_per_s'))} samples/s, {number(other.get('over_unconstrained'))}x "
                     f"unconstrained, {other['run'].get('model_steps', '-')} steps "
                     f"({other['run'].get('jump_forward_tokens', '-')} tokens by jump-forward), "
                     f"{'the same' if other.get('same_tokens') else 'OTHER'} tokens")
    elif isinstance(other, dict) and "error" in other:
        lines.append(f"the run with jump-forward the other way failed: {other['error']}")
    return "\n".join(f"- {line}" for line in lines)


def roofline_section(record: dict, previous: dict | None) -> str | None:
    roofline = record.get("roofline")
    if not isinstance(roofline, dict) or "error" in roofline:
        return None
    old = (previous or {}).get("roofline", {})
    lines = [f"prefill MFU at {roofline.get('prefill_tokens')} tokens: {number(100 * roofline.get('prefill_mfu', math.nan), 1)}%"
             + (f" (was {number(100 * old['prefill_mfu'], 1)}%)" if "prefill_mfu" in old else "") + " (target 50%)",
             f"decode step at batch 1: {number(1e3 * roofline.get('decode_batch1_seconds', math.nan), 3)} ms, "
             f"{number(roofline.get('decode_over_floor'))}x the floor"
             + (f" (was {number(old['decode_over_floor'])}x)" if "decode_over_floor" in old else "") + " (target 1.5x)"
             # records since the thirteenth session of 2026-11-28 time the step with its logits, as the
             # floor counts lm_head's weights; the graph alone is what earlier records timed
             + (f"; the graph alone {number(1e3 * roofline['decode_batch1_graph_seconds'], 3)} ms"
                if "decode_batch1_graph_seconds" in roofline else "")]
    other = roofline.get("decode_batch1_pdl")  # the same step with the other VLM_CATALOG_PDL setting
    if isinstance(other, dict) and "seconds" in other:
        lines.append(f"the same with programmatic dependent launch {'on' if other.get('pdl') else 'off'}: "
                     f"{number(1e3 * other['seconds'], 3)} ms, {number(other.get('over_floor'))}x the floor")
    elif isinstance(other, dict) and "error" in other:
        lines.append(f"the same with programmatic dependent launch {'on' if other.get('pdl') else 'off'}: "
                     f"error: {other['error']}")
    unprefetched = roofline.get("decode_batch1_pdl_without_prefetch")  # with PDL, no weight read before a wait
    if isinstance(unprefetched, dict) and ("seconds" in unprefetched or "error" in unprefetched):
        lines.append("the same with programmatic dependent launch and no weights prefetched before the wait: " + (
            f"{number(1e3 * unprefetched['seconds'], 3)} ms, {number(unprefetched.get('over_floor'))}x the floor"
            if "seconds" in unprefetched else f"error: {unprefetched['error']}"))
    unfused = roofline.get("decode_batch1_unfused")  # the same step with the newest fusions off
    if isinstance(unfused, dict) and ("seconds" in unfused or "error" in unfused):
        off = ", ".join(unfused.get("kernels_off", []))
        lines.append(f"the same with {off} off: " + (
            f"{number(1e3 * unfused['seconds'], 3)} ms, {number(unfused.get('over_floor'))}x the floor"
            if "seconds" in unfused else f"error: {unfused['error']}"))
    text = "## Roofline\n\n" + "\n".join(f"- {line}" for line in lines)
    for key in ("decode_batch1_kernels", "decode_large_batch"):
        value = roofline.get(key)
        breakdown = value.get("kernels") if isinstance(value, dict) and key == "decode_large_batch" else value
        if isinstance(value, dict) and key == "decode_large_batch":
            text += (f"\n\n{key}: {value.get('batch')} x {value.get('context')} tokens, "
                     f"{number(1e3 * value.get('seconds', math.nan), 2)} ms")
        if isinstance(breakdown, dict) and "kernels" in breakdown:
            text += f"\n\n{key} ({number(breakdown.get('total_us_per_step'), 0)} us of kernels per step):\n"
            text += "\n".join(f"- {number(row['us_per_step'], 1)} us x{number(row['calls_per_step'], 0)}: "
                              f"`{row['name'][:90]}`" for row in breakdown["kernels"][:10])
        elif isinstance(breakdown, dict) and "error" in breakdown:
            text += f"\n\n{key}: error: {breakdown['error']}"
    return text


def vision_section(record: dict, previous: dict | None) -> str | None:
    old = (previous or {}).get("vision_encoder", {})
    lines = []
    for key, vision in record.items():  # "vision_encoder", and "vision_encoder (file)" of another call
        if key.split(" (")[0] != "vision_encoder" or not isinstance(vision, dict) or "error" in vision:
            continue
        lines.append(f"- {key}: {vision.get('images')} images, {vision.get('patches')} patches: "
                     f"{number(vision.get('seconds'), 3)} s, {number(100 * vision.get('mfu', math.nan), 1)}% MFU"
                     + (f" (was {number(old['seconds'], 3)} s)" if "seconds" in old else "") + " (target 35%)")
    return "## Vision encoder\n\n" + "\n".join(lines) if lines else None


def kernel_rows_section(records: list[tuple[str, dict]]) -> str | None:
    rows = []
    for label, record in records:
        kernels = record.get("kernels", record)  # a bench_gpu record, or bench_kernels' own JSON
        for row in kernels.get("rows", []) if isinstance(kernels, dict) else []:
            if row["name"].startswith(KERNEL_ROW_PREFIXES):
                rows.append([label, row["name"], row["shape"], number(row["triton_ms"], 4),
                             number(row.get("host_ms"), 4), number(row["baseline_ms"], 4), number(row.get("speedup")),
                             row.get("note", "")[:60]])
    if not rows:
        return None
    header = ["file", "row", "shape", "ms", "host ms", "baseline ms", "speed-up", "note"]
    return ("## Kernel rows\n\n(host ms: the host's time per call of ours, launched back to back; above ms, an "
            "eager step launching it waits on the host)\n\n" + table(header, rows))


def summarize(record: dict, previous: dict | None = None, extras: list[tuple[str, dict]] = (),
              attention: list[tuple[str, dict]] = (), tuned: list[tuple[str, dict]] = ()) -> str:
    merged = dict(record)
    for label, extra in extras:  # a second call's phases (engine_fast.json, engine_async.json, vision_cudnn.json)
        for key, value in extra.items():
            if key in ENGINE_PHASES or key == "vision_encoder":
                merged[key if key not in merged else f"{key} ({label})"] = value
    header = (f"# GPU record: {record.get('device', '?')}, {record.get('date', '?')}\n\n"
              f"versions {record.get('versions', {})}; kernels_off {record.get('kernels_off', [])}; "
              f"moe_gemm {record.get('moe_gemm', '-')}; sdpa_backend {record.get('sdpa_backend', '-')}; "
              f"flash_varlen {record.get('flash_varlen', '-')}")
    sections = [header, engine_section(merged, previous), profile_section(merged),
                constrained_section(merged, previous), roofline_section(merged, previous),
                vision_section(merged, previous), kernel_rows_section([("record", record), *attention]),
                *(tuned_section(label, table_document) for label, table_document in tuned)]
    return "\n\n".join(section for section in sections if section) + "\n"


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"cannot read the record {path}: {exc}") from exc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("record", type=Path, help="bench_gpu.py's JSON")
    parser.add_argument("--previous", type=Path, help="an older record to compare with")
    parser.add_argument("--extra", type=Path, nargs="*", default=[],
                        help="other bench_gpu JSON files of the same session (engine_fast.json, vision_cudnn.json)")
    parser.add_argument("--attention", type=Path, nargs="*", default=[],
                        help="bench_kernels JSON files of the decode plan (attention*.json)")
    parser.add_argument("--tuned", type=Path, nargs="*", default=[],
                        help="tuned tables the tune plan wrote (tuned_configs.json)")
    args = parser.parse_args(argv)
    sys.stdout.write(summarize(load(args.record), load(args.previous) if args.previous else None,
                               [(path.name, load(path)) for path in args.extra],
                               [(path.name, load(path)) for path in args.attention],
                               [(path.name, load(path)) for path in args.tuned]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
