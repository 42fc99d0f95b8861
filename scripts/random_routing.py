#!/usr/bin/env python
"""How spread the benchmark's random model routes benchmark records, on the CPU.

Builds the random model (`vlm_catalog/bench/random_model.py`) at Qwen3-VL-30B-A3B's
text shapes, narrowed where asked, with a small vision tower. It then runs
`--records` synthetic benchmark records (small images, the mlperf prompt)
through the engine for 3 tokens each, sampled as the benchmark samples, and
prints what `RoutingRecorder` counted (`vlm_catalog/bench/routing_stats.py`):

- in prefill-sized router calls, the busiest 8 experts' share of the expert
  slots (uniform routing: about 6%);
- in decode-sized calls, the experts a step's tokens touched, beside what
  uniform routing touches.

The 30B's experts (128 x 768 wide, 48 layers) take 116 GB in float32.
`--expert-width` narrows them, and multiplies their down projection by
sqrt(768 / width), which keeps the variance of what they add to the residual
stream, the quantity that decides whether the routing collapses.
`--old-init` draws every weight at std 0.02, as the benchmark did until
2026-11-28.

    python scripts/random_routing.py                                         # 48 layers, width 256 (the test's shapes)
    python scripts/random_routing.py --width 2048 --expert-width 48          # the 30B's width: about 12 GB, 70 s
    python scripts/random_routing.py --width 2048 --expert-width 48 --old-init
    python scripts/random_routing.py --full-vision --image-size realistic --records 2   # image tokens as bench_gpu's
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
from pathlib import Path

import torch

from vlm_catalog.bench.random_model import QWEN3_VL_30B_A3B, benchmark_checkpoint_dir, random_model
from vlm_catalog.bench.routing_stats import RoutingRecorder

EXPERT_WIDTH = QWEN3_VL_30B_A3B["text_config"]["moe_intermediate_size"]  # 768
SMALL_VISION = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 1,
                "deepstack_visual_indexes": [0, 1]}


def routing_shapes(width: int, layers: int, expert_width: int, full_vision: bool = False) -> dict:
    """The 30B's shapes with `layers` text layers of `width`, its heads (32 query, 4 KV, 128 wide)
    scaled with the width (at least one of each), 128 experts `expert_width` wide with top-8, a
    5000-token vocabulary and a 2-block vision tower (`full_vision`: the 30B's)."""
    shapes = copy.deepcopy(QWEN3_VL_30B_A3B)
    text = shapes["text_config"]
    text.update(hidden_size=width, num_hidden_layers=layers, num_attention_heads=max(1, 32 * width // 2048),
                num_key_value_heads=max(1, 4 * width // 2048), moe_intermediate_size=expert_width,
                intermediate_size=3 * width, vocab_size=5000)
    shapes["vision_config"].update({} if full_vision else SMALL_VISION, out_hidden_size=width)
    return shapes


def routing_of_benchmark_records(directory: Path, shapes: dict, records: int = 4, tokens: int = 3,
                                 image_size: str = "small", spread_routing: bool = True) -> dict:
    """`RoutingRecorder.summary()` of `records` benchmark records run for `tokens` tokens each through
    the random model at `shapes` (float32, CPU); experts narrower than the 30B's get their down
    projection multiplied by sqrt(768 / width). Sampled as the benchmark samples: greedy decoding
    would give every record the same tokens. `spread_routing=False`: the initialisation before
    2026-11-28."""
    from vlm_catalog.data.loader import load_catalogue
    from vlm_catalog.data.synthetic.generator import make_catalog
    from vlm_catalog.engine.config import EngineConfig
    from vlm_catalog.engine.generation_config import QWEN3_VL_SAMPLING
    from vlm_catalog.engine.llm_engine import LLMEngine
    from vlm_catalog.preprocess.prompt import build_messages

    checkpoint = benchmark_checkpoint_dir(directory / "checkpoint", shapes)
    model = random_model(checkpoint, "cpu", torch.float32, spread_routing=spread_routing)
    gain = math.sqrt(EXPERT_WIDTH / shapes["text_config"]["moe_intermediate_size"])
    if gain != 1.0:
        with torch.no_grad():
            for layer in model.language_model.layers:
                layer.mlp.experts.down_proj.mul_(gain)
    catalogue = list(load_catalogue(make_catalog(directory / "catalogue", records, 11, image_size=image_size)))
    engine = LLMEngine(EngineConfig(model=checkpoint, max_num_batched_tokens=16384), prebuilt_model=model)
    for seed, record in enumerate(catalogue):
        engine.add_request(build_messages(record), QWEN3_VL_SAMPLING.params(max_tokens=tokens, ignore_eos=True, seed=seed))
    with RoutingRecorder(model) as recorder:
        while engine.has_unfinished_requests():
            engine.step()
    engine.close()
    return recorder.summary()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=256, help="text hidden size (the 30B's: 2048)")
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--expert-width", type=int, default=96, help="expert intermediate size (the 30B's: 768)")
    parser.add_argument("--records", type=int, default=4)
    parser.add_argument("--full-vision", action="store_true", help="the 30B's vision tower (27 blocks of 1152)")
    parser.add_argument("--image-size", choices=("small", "realistic"), default="small",
                        help="the synthetic catalogue's images (realistic: 500-2000 px, as bench_gpu.py's)")
    parser.add_argument("--old-init", action="store_true", help="every weight at std 0.02 (the benchmark until 2026-11-28)")
    args = parser.parse_args(argv)
    for name, value in (("--width", args.width), ("--layers", args.layers), ("--expert-width", args.expert_width),
                        ("--records", args.records)):
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    with tempfile.TemporaryDirectory() as scratch:
        shapes = routing_shapes(args.width, args.layers, args.expert_width, args.full_vision)
        summary = routing_of_benchmark_records(Path(scratch), shapes, args.records, image_size=args.image_size,
                                               spread_routing=not args.old_init)
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
