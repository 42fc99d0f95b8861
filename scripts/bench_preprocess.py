#!/usr/bin/env python
"""Image preprocessing: ours vs transformers' Qwen2VLImageProcessorPil, side by side.

Builds N varied JPEGs in memory (gradients + noise + shapes, quality 90), checks
that our output equals transformers' on every one (grid identical, pixel values
within 1e-5), then times, from the same JPEG bytes:

* transformers: ``Image.open`` + ``Qwen2VLImageProcessorPil(...)(image)`` (decode
  happens inside the timed call), one image at a time;
* ours, one image at a time, with per-stage times (decode / resize /
  normalise+patchify, each timed on its own); "decode" is everything before
  the resize: data parsing, hashing, JPEG decode, EXIF check, RGB rule;
* ours, ``process_many`` over the whole batch in a thread pool;
* transformers in the same thread pool, for an apples-to-apples pool ratio.

Reports medians per image over repeats after warm-up. The variants are
interleaved image by image (see ``measure``), so a busy machine slows them
alike; the paired ratio is the median over images of transformers' time / ours.
``torch`` runs with ``--torch-threads`` intra-op threads (default 1, so "one
thread" means one).

    .venv/bin/python scripts/bench_preprocess.py --json out/bench_preprocess.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import PIL
import torch
import transformers
from PIL import Image, ImageDraw
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlm_catalog.bench.baselines import transformers_image_processor  # noqa: E402
from vlm_catalog.preprocess.image import ImageProcessor  # noqa: E402

TOLERANCE = 1e-5


def available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def make_jpeg(rng: np.random.Generator, size: int, quality: int = 90) -> bytes:
    """A photo-like test image: colour gradient, sensor noise, random shapes."""
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    angle = rng.uniform(0, 2 * np.pi)
    ramp = np.cos(angle) * x + np.sin(angle) * y  # [H, W]
    low, high = rng.uniform(0, 255, 3), rng.uniform(0, 255, 3)
    pixels = low + (high - low) * ramp[..., None]  # [H, W, 3]
    pixels += rng.normal(0, rng.uniform(4, 20), pixels.shape)
    image = Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(8, 20))):
        x0, y0 = rng.integers(0, size, 2)
        x1, y1 = x0 + rng.integers(10, size // 2), y0 + rng.integers(10, size // 2)
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = rng.integers(0, 4)
        if kind == 0:
            draw.ellipse((x0, y0, x1, y1), fill=colour)
        elif kind == 1:
            draw.rectangle((x0, y0, x1, y1), fill=colour)
        elif kind == 2:
            draw.line((x0, y0, x1, y1), fill=colour, width=int(rng.integers(1, 12)))
        else:
            points = [tuple(int(v) for v in rng.integers(0, size, 2)) for _ in range(5)]
            draw.polygon(points, fill=colour)
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def run_reference(reference: Qwen2VLImageProcessorPil, data: bytes):
    return reference(Image.open(io.BytesIO(data)), return_tensors="pt")


def check_equal(ours: ImageProcessor, reference, jpegs: list[bytes]) -> float:
    worst = 0.0
    for index, data in enumerate(jpegs):
        expected = run_reference(reference, data)
        got = ours.process(data)
        grid = tuple(expected["image_grid_thw"][0].tolist())
        if grid != got.grid_thw or expected["pixel_values"].shape != got.pixel_values.shape:
            sys.exit(f"image {index}: grid {got.grid_thw} != transformers {grid}")
        diff = (expected["pixel_values"] - got.pixel_values).abs().max().item()
        if diff > TOLERANCE:
            sys.exit(f"image {index}: max abs diff {diff:.3g} > {TOLERANCE}")
        worst = max(worst, diff)
    return worst


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed_with_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads)."""
    cpu_start, start = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - start, time.process_time() - cpu_start


def measure(ours: ImageProcessor, reference, jpegs: list[bytes], workers: int,
            warmup: int, repeats: int) -> dict[str, list[float]]:
    """Seconds per image, interleaved so background load hits every variant alike.

    Each repeat runs, image by image, transformers then ours then our three
    stages; then the whole batch through our pool and through transformers in
    the same pool. CPU time (all threads) is kept too: unlike wall time it does
    not grow when other processes take the CPUs, and on k idle cores throughput
    is about k / CPU time per image.
    """
    samples: dict[str, list[float]] = {
        "transformers": [], "ours_single": [], "ratio_single": [],
        "decode": [], "resize": [], "normalise_patchify": [],
        "ours_pool": [], "transformers_pool": [],
        "transformers_cpu": [], "ours_single_cpu": [], "ours_pool_cpu": [],
    }

    def reference_pool() -> None:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda d: run_reference(reference, d), jpegs))

    for repeat in range(warmup + repeats):
        keep = repeat >= warmup
        for data in jpegs:
            reference_s, reference_cpu = timed_with_cpu(lambda d=data: run_reference(reference, d))
            ours_s, ours_cpu = timed_with_cpu(lambda d=data: ours.process(d))
            t0 = time.perf_counter()
            rgb, _ = ours.load(data)
            t1 = time.perf_counter()
            resized = ours.resize(rgb)
            t2 = time.perf_counter()
            ours.patchify(resized)
            t3 = time.perf_counter()
            if keep:
                samples["transformers"].append(reference_s)
                samples["ours_single"].append(ours_s)
                samples["ratio_single"].append(reference_s / ours_s)
                samples["transformers_cpu"].append(reference_cpu)
                samples["ours_single_cpu"].append(ours_cpu)
                samples["decode"].append(t1 - t0)
                samples["resize"].append(t2 - t1)
                samples["normalise_patchify"].append(t3 - t2)
        ours_pool_s, ours_pool_cpu = timed_with_cpu(
            lambda: ours.process_many(jpegs, num_workers=workers))
        reference_pool_s = timed(reference_pool)
        if keep:
            samples["ours_pool"].append(ours_pool_s / len(jpegs))
            samples["ours_pool_cpu"].append(ours_pool_cpu / len(jpegs))
            samples["transformers_pool"].append(reference_pool_s / len(jpegs))
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-images", type=int, default=32)
    parser.add_argument("--size", type=int, default=1000, help="side of the square JPEGs")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--workers", type=int, default=None,
                        help="thread pool size (default: the CPUs we may run on)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args(argv)

    torch.set_num_threads(args.torch_threads)
    rng = np.random.default_rng(args.seed)
    jpegs = [make_jpeg(rng, args.size) for _ in range(args.num_images)]
    ours = ImageProcessor()  # Qwen3-VL defaults
    reference = transformers_image_processor(ours)
    workers = args.workers or available_cpus()

    worst = check_equal(ours, reference, jpegs)
    print(f"equality: {len(jpegs)} images, grids identical, max abs diff {worst:.3g} "
          f"(tolerance {TOLERANCE})")

    load_before = os.getloadavg()[0]
    samples = measure(ours, reference, jpegs, workers, args.warmup, args.repeats)
    load_after = os.getloadavg()[0]
    median = {name: statistics.median(values) for name, values in samples.items()}
    reference_s, ours_s = median["transformers"], median["ours_single"]
    ours_pool_s, reference_pool_s = median["ours_pool"], median["transformers_pool"]
    stages = {name: median[name] for name in ("decode", "resize", "normalise_patchify")}

    ms = 1e3
    avg_kb = sum(map(len, jpegs)) / len(jpegs) / 1024
    print(f"images: {len(jpegs)} JPEGs {args.size}x{args.size} q90 (avg {avg_kb:.0f} KiB), "
          f"grid {ours.process(jpegs[0]).grid_thw}; torch threads {args.torch_threads}, "
          f"pool workers {workers}; median per image over {args.repeats} repeats "
          f"after {args.warmup} warm-up; 1-min load average {load_before:.2f} -> "
          f"{load_after:.2f} on {available_cpus()} CPUs")
    print(f"transformers PIL processor      {reference_s * ms:7.2f} ms/image")
    print(f"ours, one thread                {ours_s * ms:7.2f} ms/image   "
          f"speedup {reference_s / ours_s:4.2f}x "
          f"(median of paired ratios {median['ratio_single']:4.2f}x)")
    for name, seconds in stages.items():
        print(f"  {name:<29} {seconds * ms:7.2f} ms")
    print(f"ours, process_many ({workers} threads)  {ours_pool_s * ms:7.2f} ms/image   "
          f"speedup {reference_s / ours_pool_s:4.2f}x vs transformers single")
    print(f"transformers, same pool         {reference_pool_s * ms:7.2f} ms/image   "
          f"(ours pooled is {reference_pool_s / ours_pool_s:4.2f}x faster)")
    cpu = {name: median[f"{name}_cpu"] for name in ("transformers", "ours_single", "ours_pool")}
    idle_estimate = workers * cpu["transformers"] / cpu["ours_pool"]
    print(f"CPU time per image (all threads; robust to other load): transformers "
          f"{cpu['transformers'] * ms:.2f} ms, ours {cpu['ours_single'] * ms:.2f} ms one thread "
          f"({cpu['transformers'] / cpu['ours_single']:4.2f}x less), "
          f"{cpu['ours_pool'] * ms:.2f} ms in the pool")
    print(f"estimated pool throughput on {workers} idle CPUs: {idle_estimate:4.2f}x "
          "transformers single-threaded (CPUs / pooled CPU time per image)")
    best = reference_s / min(ours_s, ours_pool_s)
    print(f"target >= 3x vs transformers: best {best:4.2f}x -> {'met' if best >= 3 else 'NOT met'}")

    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpus": available_cpus(), "torch": torch.__version__,
                        "pillow": PIL.__version__, "transformers": transformers.__version__},
            "images": len(jpegs), "size": args.size, "repeats": args.repeats,
            "warmup": args.warmup, "torch_threads": args.torch_threads, "workers": workers,
            "load_average_1min": [load_before, load_after],
            "max_abs_diff": worst,
            "ms_per_image": {
                "transformers": reference_s * ms,
                "ours_single": ours_s * ms,
                "ours_stages": {k: v * ms for k, v in stages.items()},
                "ours_pool": ours_pool_s * ms,
                "transformers_pool": reference_pool_s * ms,
            },
            "cpu_ms_per_image": {k: v * ms for k, v in cpu.items()},
            "estimated_pool_speedup_on_idle_cpus": idle_estimate,
            "speedup": {
                "single": reference_s / ours_s,
                "single_paired_median": median["ratio_single"],
                "pool_vs_transformers_single": reference_s / ours_pool_s,
                "pool_vs_transformers_pool": reference_pool_s / ours_pool_s,
            },
        }, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
