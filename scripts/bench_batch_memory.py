"""Peak memory of `vlm-catalog extract` against the dataset's size (the issue's target: 1,000
realistic records within 1.25x of 100).

For each size N: a synthetic catalogue of N records with realistic images
(`vlm-catalog make-catalog --image-size realistic`, the benchmark's 500-2000 px
JPEG mix), then one fresh `vlm-catalog extract` process over it; its peak RSS
is the child's `ru_maxrss` from `os.wait4`. Prints one line per size and the
ratio of the largest to the smallest.

    .venv/bin/python scripts/bench_batch_memory.py --sizes 100 1000 --max-tokens 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

CLI = [sys.executable, "-m", "vlm_catalog.cli"]


def make_catalogue(size: int, workdir: Path, seed: int) -> Path:
    directory = workdir / f"catalogue-{size}"
    if not (directory / "data").is_dir():
        subprocess.run([*CLI, "make-catalog", "--n", str(size), "--seed", str(seed), "--out", str(directory),
                        "--image-size", "realistic"], check=True, stdout=subprocess.DEVNULL)
    return directory


def peak_rss_of_extract(dataset: Path, out: Path, max_tokens: int, extra: list[str]) -> tuple[float, float, str]:
    """(peak RSS in MiB, wall seconds, the summary's first line) of one extract process."""
    command = [*CLI, "extract", "--dataset", str(dataset), "--out", str(out), "--overwrite",
               "--max-tokens", str(max_tokens), *extra]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise SystemExit(f"extract over {dataset} exited with {code}")
    return usage.ru_maxrss / 1024, seconds, stdout.splitlines()[0] if stdout else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=Path("scratch/bench_batch_memory"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("extract_args", nargs="*", help="more `extract` options after --, e.g. -- --window 32")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    peaks = {}
    for size in args.sizes:
        dataset = make_catalogue(size, args.workdir, args.seed)
        on_disk = sum(f.stat().st_size for f in (dataset / "data").glob("*.parquet")) / 2**20
        peak, seconds, summary = peak_rss_of_extract(
            dataset, args.workdir / f"predictions-{size}.jsonl", args.max_tokens, args.extract_args
        )
        peaks[size] = peak
        print(f"{size:6d} records ({on_disk:7.1f} MiB parquet): peak RSS {peak:8.1f} MiB, "
              f"{seconds:6.1f} s wall | {summary}", flush=True)
    smallest, largest = min(peaks), max(peaks)
    print(f"peak RSS ratio {largest} / {smallest} records: {peaks[largest] / peaks[smallest]:.3f}")


if __name__ == "__main__":
    main()
