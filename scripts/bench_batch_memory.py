"""Peak memory of `vlm-catalog extract` against the dataset's size (the issue's target: 1,000
realistic records within 1.25x of 100).

For each size N: a synthetic catalogue of N records with realistic images
(`vlm-catalog make-catalog --image-size realistic`, the benchmark's 500-2000 px
JPEG mix), then one fresh `vlm-catalog extract` process over it; its peak RSS
is the child's `ru_maxrss` from `os.wait4`. Prints one line per size and the
ratio of the largest to the smallest.

With `--sample-every-s S` it also samples the process's RSS every S seconds
(beside the number of answers written so far) and prints the highest RSS in
each tenth of the records: whether memory keeps growing over a long run.

    .venv/bin/python scripts/bench_batch_memory.py --sizes 100 1000 --max-tokens 20
    .venv/bin/python scripts/bench_batch_memory.py --sizes 10000 --max-tokens 20 --sample-every-s 5
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

CLI = [sys.executable, "-m", "vlm_catalog.cli"]


def make_catalogue(size: int, workdir: Path, seed: int) -> Path:
    directory = workdir / f"catalogue-{size}"
    if not (directory / "data").is_dir():
        subprocess.run([*CLI, "make-catalog", "--n", str(size), "--seed", str(seed), "--out", str(directory),
                        "--image-size", "realistic"], check=True, stdout=subprocess.DEVNULL)
    return directory


def peak_rss_of_extract(
    dataset: Path, out: Path, max_tokens: int, extra: list[str], sample_every_s: float = 0.0
) -> tuple[float, float, str, list[tuple[float, float, int]]]:
    """(peak RSS in MiB, wall seconds, the summary's first line, RSS samples) of one extract
    process; each sample is (seconds, RSS in MiB, answers written)."""
    command = [*CLI, "extract", "--dataset", str(dataset), "--out", str(out), "--overwrite",
               "--max-tokens", str(max_tokens), *extra]
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    samples: list[tuple[float, float, int]] = []
    done = threading.Event()
    if sample_every_s > 0:
        threading.Thread(target=_sample, args=(process.pid, out, sample_every_s, started, samples, done),
                         daemon=True).start()
    stdout = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    done.set()
    seconds = time.perf_counter() - started
    code = os.waitstatus_to_exitcode(status)
    if code not in (0, 3):
        raise SystemExit(f"extract over {dataset} exited with {code}")
    return usage.ru_maxrss / 1024, seconds, stdout.splitlines()[0] if stdout else "", samples


def _sample(pid: int, out: Path, every_s: float, started: float, samples: list, done: threading.Event) -> None:
    while not done.wait(every_s):
        try:
            with open(f"/proc/{pid}/status") as status:
                rss_mib = int(status.read().split("VmRSS:")[1].split()[0]) / 1024
            with out.open("rb") as answers:
                written = sum(1 for _ in answers)
        except (OSError, IndexError):  # the process is exiting, or nothing is written yet
            continue
        samples.append((time.perf_counter() - started, rss_mib, written))


def highest_rss_per_tenth(samples: list[tuple[float, float, int]], records: int) -> list[tuple[int, float]]:
    """(first record of the tenth, highest RSS sampled while answers in that tenth were written)."""
    tenth = max(1, -(-records // 10))
    highest: dict[int, float] = {}
    for _, rss_mib, written in samples:
        bucket = min(written, records - 1) // tenth * tenth
        highest[bucket] = max(highest.get(bucket, 0.0), rss_mib)
    return sorted(highest.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--max-tokens", type=int, default=20)
    parser.add_argument("--workdir", type=Path, default=Path("scratch/bench_batch_memory"))
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--sample-every-s", type=float, default=0.0, help="also sample RSS this often (0: only the peak)")
    parser.add_argument("extract_args", nargs="*", help="more `extract` options after --, e.g. -- --window 32")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    peaks = {}
    for size in args.sizes:
        dataset = make_catalogue(size, args.workdir, args.seed)
        on_disk = sum(f.stat().st_size for f in (dataset / "data").glob("*.parquet")) / 2**20
        peak, seconds, summary, samples = peak_rss_of_extract(
            dataset, args.workdir / f"predictions-{size}.jsonl", args.max_tokens, args.extract_args,
            args.sample_every_s,
        )
        peaks[size] = peak
        print(f"{size:6d} records ({on_disk:7.1f} MiB parquet): peak RSS {peak:8.1f} MiB, "
              f"{seconds:6.1f} s wall | {summary}", flush=True)
        if samples:
            cells = ", ".join(f"{first}+: {rss:.0f}" for first, rss in highest_rss_per_tenth(samples, size))
            print(f"       highest sampled RSS (MiB) by records written: {cells}", flush=True)
    smallest, largest = min(peaks), max(peaks)
    print(f"peak RSS ratio {largest} / {smallest} records: {peaks[largest] / peaks[smallest]:.3f}")


if __name__ == "__main__":
    main()
