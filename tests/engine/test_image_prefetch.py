"""Image prefetching: what is held (the longest upcoming prefix within the byte budget), that a
prefetched image is decoded once, that images needed now never queue behind prefetches, and
that an engine with prefetching gives the same answers as one without."""

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import conversation
from tests.model.helpers import noise_image
from vlm_catalog import LLM, SamplingParams
from vlm_catalog.engine.image_prefetch import ImagePrefetcher
from vlm_catalog.preprocess.image import ImageProbe

REPO_ROOT = Path(__file__).resolve().parents[2]


def probe(name: str, patches: int = 4) -> ImageProbe:
    return ImageProbe(source=name.encode(), grid_thw=(1, 2, patches // 2), num_tokens=patches // 4, content_hash=name)


class FakeDecoder:
    """Decodes an image to a tensor holding its name's length; counts calls; "bad" images fail;
    images in `blocked` wait until `release` is set."""

    def __init__(self, blocked: tuple[str, ...] = ()) -> None:
        self.calls: Counter[str] = Counter()
        self.blocked = set(blocked)
        self.release = threading.Event()
        self.lock = threading.Lock()

    def __call__(self, image: ImageProbe) -> torch.Tensor | str:
        with self.lock:
            self.calls[image.content_hash] += 1
        if image.content_hash in self.blocked:
            assert self.release.wait(10)
        if image.content_hash.startswith("bad"):
            return f"image could not be decoded: {image.content_hash}"
        return torch.full((2,), float(len(image.content_hash)))


def bytes_of(image: ImageProbe) -> int:
    return image.grid_thw[2] * 100  # 100 bytes per column: easy budgets


@pytest.fixture
def decoder():
    return FakeDecoder()


def test_holds_the_longest_upcoming_prefix_that_fits(decoder):
    prefetcher = ImagePrefetcher(decoder, bytes_of, max_bytes=500, workers=2)
    a, b, c, d = probe("a", 4), probe("b", 4), probe("c", 4), probe("d", 2)  # 200, 200, 200, 100 bytes
    prefetcher.prefetch([a, b, a, c, d])  # a counts once; c does not fit, and nothing after it is held
    assert prefetcher.held_hashes == ["a", "b"]
    assert prefetcher.held_bytes == 400
    prefetcher.prefetch([d, b, c, a])  # a comes last now and no longer fits: dropped
    assert prefetcher.held_hashes == ["d", "b", "c"]
    assert prefetcher.held_bytes == 500
    assert prefetcher.num_dropped == 1
    prefetcher.prefetch([b])  # the others are no longer upcoming
    assert prefetcher.held_hashes == ["b"] and prefetcher.held_bytes == 200
    assert prefetcher.num_dropped == 3
    assert decoder.calls["b"] == 1
    prefetcher.close()


def test_reads_upcoming_only_as_far_as_the_budget_reaches(decoder):
    prefetcher = ImagePrefetcher(decoder, bytes_of, max_bytes=400, workers=1)
    read = []

    def upcoming():
        for index in range(1_000_000):
            read.append(index)
            yield probe(f"image{index}", 4)

    prefetcher.prefetch(upcoming())
    assert len(read) == 3  # two fit, the third is over the budget
    prefetcher.close()


def test_a_prefetched_image_is_decoded_once_and_taken_once(decoder):
    prefetcher = ImagePrefetcher(decoder, bytes_of, max_bytes=10_000, workers=2)
    images = [probe("a"), probe("bb"), probe("bad-one")]
    prefetcher.prefetch(images)
    prefetcher.prefetch(images)  # still upcoming: nothing decoded again
    results = prefetcher.take([images[1], probe("ccc"), images[2]])
    assert results[0].tolist() == [2.0, 2.0] and results[1].tolist() == [3.0, 3.0]
    assert results[2] == "image could not be decoded: bad-one"  # errors come back as messages
    assert decoder.calls == {"a": 1, "bb": 1, "bad-one": 1, "ccc": 1}
    assert (prefetcher.num_prefetch_hits, prefetcher.num_decoded_on_demand) == (2, 1)
    assert prefetcher.held_hashes == ["a"] and prefetcher.held_bytes == bytes_of(images[0])
    prefetcher.take([images[1]])  # taken before: decoded again, on demand
    assert decoder.calls["bb"] == 2
    prefetcher.close()


def test_images_needed_now_do_not_wait_for_prefetches():
    decoder = FakeDecoder(blocked=("slow1", "slow2"))
    prefetcher = ImagePrefetcher(decoder, bytes_of, max_bytes=10_000, workers=2)
    prefetcher.prefetch([probe("slow1"), probe("slow2"), probe("later")])  # both prefetch threads blocked
    done = threading.Event()
    result = []
    worker = threading.Thread(target=lambda: (result.extend(prefetcher.take([probe("now")])), done.set()))
    worker.start()
    assert done.wait(5), "an on-demand decode queued behind blocked prefetches"
    assert result[0].tolist() == [3.0, 3.0]
    decoder.release.set()
    worker.join()
    prefetcher.close()


def test_a_zero_budget_prefetches_nothing_and_a_negative_one_is_refused(decoder):
    prefetcher = ImagePrefetcher(decoder, bytes_of, max_bytes=0)
    prefetcher.prefetch([probe("a")])
    assert prefetcher.held_hashes == [] and not decoder.calls
    assert prefetcher.take([probe("a")])[0].tolist() == [1.0, 1.0]
    prefetcher.close()
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ImagePrefetcher(decoder, bytes_of, max_bytes=-1)


# ------------------------------------------------------------------ engine
def image_conversations(count: int) -> list[list[dict]]:
    """One image each, every third also a second one; the image of record 5 repeats in record 6."""
    conversations = [conversation(index, images=1 + (index % 3 == 0), words=4) for index in range(count)]
    conversations[6] = conversation(5, images=1, words=9)
    return conversations


def run(engine_checkpoint, conversations, prefetch_bytes: int, **options):
    # small steps: requests are admitted over many steps, so later images can be prefetched
    llm = LLM(engine_checkpoint, max_num_batched_tokens=96, max_num_seqs=4, image_prefetch_bytes=prefetch_bytes,
              enable_prefix_caching=False, **options)
    outputs = llm.chat(conversations, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0))
    stats, images = llm.engine.stats, llm.engine.runner.images
    llm.engine.close()
    return outputs, stats, images


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: pixels are staged in bf16 on the host
def test_prefetching_gives_the_same_answers_and_decodes_each_image_once(engine_checkpoint, dtype):
    conversations = image_conversations(12)
    plain, plain_stats, _ = run(engine_checkpoint, conversations, prefetch_bytes=0, dtype=dtype)
    fetched, stats, images = run(engine_checkpoint, conversations, prefetch_bytes=64 * 2**20, dtype=dtype)
    assert [o.token_ids for o in fetched] == [o.token_ids for o in plain]
    assert plain_stats.num_images_prefetched == 0
    assert stats.num_images_prefetched > 0
    assert stats.num_images_prefetched == images.num_prefetch_hits
    # every distinct image decoded once (none dropped: the budget holds them all; the encoder cache too)
    distinct = {part["image"] for messages in conversations for part in messages[0]["content"] if "image" in part}
    assert len(distinct) == 14
    assert images.num_dropped == 0
    assert images.num_prefetch_hits + images.num_decoded_on_demand == len(distinct)
    assert stats.seconds_waiting_for_images >= 0.0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pixels_cross_as_uint8_and_normalise_on_the_device_to_exactly_the_preprocessors(engine_checkpoint, dtype):
    """The runner stages decoded images as uint8 patch rows (half the bytes of bf16 to copy)
    and normalises them on the device: the patch embedding gets exactly the preprocessor's
    float32 pixels in its dtype, so the features are the same."""
    llm = LLM(engine_checkpoint, dtype=dtype)
    runner, model = llm.engine.runner, llm.engine.model
    image_processor = llm.engine.processor.image_processor
    prompt = llm.engine.processor.process(conversation(2, images=2))
    sources = [image.source for image in prompt.images]
    pixels, grids = llm.engine.processor.load_pixels(prompt.images)  # float32, normalised on the host
    staged = [runner._staged(image_processor.process_bytes(source).pixel_values) for source in sources]
    assert all(part.dtype == torch.uint8 for part in staged)
    assert sum(part.numel() for part in staged) == sum(runner._staged_bytes(image) for image in prompt.images)
    on_device = runner.normalised(torch.cat(staged))
    assert on_device.dtype == model.visual.patch_embed.pixel_dtype == getattr(torch, dtype)
    assert torch.equal(on_device, pixels.to(on_device.dtype))
    for expected, got in zip(model.encode_images(pixels, grids), model.encode_images(on_device, grids), strict=True):
        assert torch.equal(expected.embeddings, got.embeddings)
        assert all(torch.equal(a, b) for a, b in zip(expected.deepstack, got.deepstack, strict=True))
    llm.engine.close()


def test_staging_falls_back_to_pageable_memory_when_pinning_fails(engine_checkpoint, monkeypatch):
    llm = LLM(engine_checkpoint, dtype="bfloat16")
    runner = llm.engine.runner
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # stage as for CUDA ...

    def no_pinned_memory(*args, **kwargs):
        raise RuntimeError("cudaHostAlloc failed")  # ... where pinned memory has run out

    monkeypatch.setattr(torch, "empty", no_pinned_memory)
    pixel_bytes = torch.randint(0, 256, (8, runner.model.config.vision.patch_dim), dtype=torch.uint8)
    staged = runner._staged(pixel_bytes)
    assert staged.dtype == torch.uint8 and torch.equal(staged, pixel_bytes)
    monkeypatch.undo()
    llm.engine.close()


def test_a_prefetched_image_that_fails_to_decode_fails_only_its_request(engine_checkpoint):
    whole = noise_image(64, 64, seed=9, fmt="JPEG")
    conversations = image_conversations(8)
    conversations[7] = [{"role": "user", "content": [{"type": "image", "image": whole[: len(whole) * 2 // 3]}]}]
    outputs, stats, images = run(engine_checkpoint, conversations, prefetch_bytes=64 * 2**20)
    assert stats.num_images_prefetched > 0
    assert outputs[7].finish_reason == "error" and "could not be decoded" in outputs[7].error
    assert [o.finish_reason for o in outputs[:7]] == ["length"] * 7
    assert images.held_hashes == []  # nothing left held once every request is done


def test_prefetching_is_on_by_default_on_cuda_only_and_a_negative_budget_is_refused(engine_checkpoint):
    from vlm_catalog.engine.config import CUDA_IMAGE_PREFETCH_BYTES, EngineConfig, EngineConfigError

    assert EngineConfig(model=engine_checkpoint, device="cpu").image_prefetch_bytes == 0
    assert EngineConfig(model=engine_checkpoint, device="cuda:0").image_prefetch_bytes == CUDA_IMAGE_PREFETCH_BYTES
    assert EngineConfig(model=engine_checkpoint, image_prefetch_bytes=7).image_prefetch_bytes == 7
    with pytest.raises(EngineConfigError, match="image_prefetch_bytes must be >= 0"):
        EngineConfig(model=engine_checkpoint, image_prefetch_bytes=-1)


def test_bench_script_compares_both_settings(tmp_path):
    out = tmp_path / "prefetch.json"
    result = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "bench_image_prefetch.py"), "--records", "12",
         "--image-size", "small", "--max-tokens", "2", "--rounds", "1", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["same_tokens"] is True and report["records"] == 12
    off, on = report["runs"]
    assert off["image_prefetch_bytes"] == 0 and off["images_prefetched"] == 0
    assert on["image_prefetch_bytes"] > 0 and on["images_prefetched"] > 0
