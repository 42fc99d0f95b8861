#!/usr/bin/env python
"""How prompt-preparing threads slow a device-driving thread through the GIL.

On a GPU host the engine thread spends most of a step waiting for the device
(the GIL released) and a few milliseconds of Python host work in between
(scheduling, inputs, sampling bookkeeping). Threads preparing prompts (chat
template, tokens, image headers: `PromptProcessor.process`, mostly Python)
take the GIL whenever the engine thread lets it go, and the engine thread
then gets it back only at the interpreter's switch interval (5 ms), and
shares it while its host work runs. This models the engine thread as a loop
of `--device-ms` of sleep (the device's step, GIL released) and `--host-ms` of
pure-Python work, and times the loop:
- alone;
- beside 1 and 2 threads preparing realistic benchmark prompts without pause
  (the LoadGen SUT used to prepare a whole Offline burst at once: 48k samples,
  about two minutes of such work);
- beside 2 threads preparing `--prompts-per-step` prompts per step (a bounded
  read-ahead that only replaces finished records; 20 samples/s at 20 ms
  steps is 0.4 per step).

No device and no model are needed: the cost is the interpreter's, the same on
any machine with spare cores (on the 2-core CPU machine the threads also
compete for cores).

    python scripts/bench_gil_contention.py [--steps 100] [--device-ms 18] [--host-ms 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

from vlm_catalog.data.loader import load_catalogue
from vlm_catalog.data.synthetic.generator import make_catalog
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.preprocess.processor import PromptProcessor
from vlm_catalog.preprocess.prompt import build_messages


def python_work(seconds: float) -> None:
    """Pure-Python work (holds the GIL) for `seconds` of this thread's running time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(200))


def engine_loop(steps: int, device_s: float, host_s: float, on_step=None) -> float:
    """Mean ms per step of `device_s` of waiting (GIL released) and `host_s` of Python."""
    started = time.perf_counter()
    for _ in range(steps):
        if on_step is not None:
            on_step()
        time.sleep(device_s)
        python_work(host_s)
    return 1e3 * (time.perf_counter() - started) / steps


def with_preparing_threads(threads: int, prepare, measure, tokens: threading.Semaphore | None = None) -> float:
    """`measure()` while `threads` threads call `prepare()`: without pause, or one call per token released."""
    stop = threading.Event()

    def worker() -> None:
        while not stop.is_set():
            if tokens is not None and not tokens.acquire(timeout=0.05):
                continue
            prepare()

    workers = [threading.Thread(target=worker, daemon=True) for _ in range(threads)]
    for thread in workers:
        thread.start()
    try:
        return measure()
    finally:
        stop.set()
        for thread in workers:
            thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--device-ms", type=float, default=18.0, help="the device's step (the first H100 run's median)")
    parser.add_argument("--host-ms", type=float, default=3.0, help="Python host work per step")
    parser.add_argument("--prompts-per-step", type=float, default=0.4, help="the bounded case's preparation rate")
    parser.add_argument("--records", type=int, default=16, help="realistic records cycled through by the preparers")
    parser.add_argument("--json", dest="json_out", type=Path)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as scratch:
        records = list(load_catalogue(make_catalog(Path(scratch) / "catalogue", args.records, 4242, "realistic")))
    config = ModelConfig.from_pretrained(DEFAULT_MODEL_DIR)
    processor = PromptProcessor.from_pretrained(DEFAULT_MODEL_DIR, image_token_id=config.image_token_id)
    conversations = [build_messages(record) for record in records]
    counter = iter(range(10**12))

    def prepare() -> None:
        processor.process(conversations[next(counter) % len(conversations)])

    started = time.perf_counter()
    for _ in range(20):
        prepare()
    prepare_ms = 1e3 * (time.perf_counter() - started) / 20

    device_s, host_s = args.device_ms / 1e3, args.host_ms / 1e3

    def measure(on_step=None) -> float:
        return engine_loop(args.steps, device_s, host_s, on_step)

    credit = [0.0]
    tokens = threading.Semaphore(0)

    def release_tokens() -> None:  # the bounded case: prompts to prepare arrive at a steady rate
        credit[0] += args.prompts_per_step
        while credit[0] >= 1:
            credit[0] -= 1
            tokens.release()

    report = {
        "device_ms": args.device_ms, "host_ms": args.host_ms, "prepare_ms_per_prompt": round(prepare_ms, 3),
        "switch_interval_ms": sys.getswitchinterval() * 1e3,
        "ms_per_step": {
            "alone": round(measure(), 2),
            "1 thread preparing without pause": round(with_preparing_threads(1, prepare, measure), 2),
            "2 threads preparing without pause": round(with_preparing_threads(2, prepare, measure), 2),
            f"2 threads preparing {args.prompts_per_step} prompts per step": round(
                with_preparing_threads(2, prepare, lambda: measure(release_tokens), tokens), 2
            ),
        },
    }
    print(f"ideal {args.device_ms + args.host_ms:.1f} ms per step ({args.device_ms:g} device + {args.host_ms:g} host); "
          f"a prompt takes {prepare_ms:.2f} ms to prepare")
    for case, ms in report["ms_per_step"].items():
        print(f"  {case:45s} {ms:7.2f} ms per step")
    if args.json_out:
        args.json_out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
