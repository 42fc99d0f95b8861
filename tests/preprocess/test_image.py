"""ImageProcessor against transformers' Qwen2VLImageProcessorPil, plus config and batching.

Tolerance: grids identical, pixel values max abs diff <= 1e-5 (we measure ~1.2e-7:
one float32 rounding of the fused scale-and-offset normalisation).
"""

from __future__ import annotations

import base64
import io
import json
import math
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from vlm_catalog.bench.baselines import (
    transformers_image_processor,
    transformers_pil_image_processor_class,
    transformers_smart_resize,
    white_background_rgb,
)
from vlm_catalog.preprocess.image import ImageProcessor, ProcessedImage, smart_resize
from vlm_catalog.preprocess.image_decode import DecodeFailure, ImageDecodeError

TOLERANCE = 1e-5

QWEN3_VL = ImageProcessor()  # the defaults are Qwen3-VL's
# Qwen2-VL's patch 14 and CLIP statistics, with a small max_pixels so that the
# downscaling branch of smart_resize runs on test-sized images.
QWEN2_VL_STYLE = ImageProcessor(
    patch_size=14,
    min_pixels=56 * 56,
    max_pixels=160_000,
    image_mean=tuple(OPENAI_CLIP_MEAN),
    image_std=tuple(OPENAI_CLIP_STD),
)


def encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def photo(height: int, width: int, seed: int = 0) -> Image.Image:
    """Gradient + noise + a few shapes: resampling sees real structure."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width, 1), y * 255 / max(height, 1),
                     (x + y) * 127 / max(width + height, 1)], axis=-1)
    pixels = np.clip(base + rng.normal(0, 25, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    draw.ellipse((width * 0.2, height * 0.1, width * 0.7, height * 0.8), fill=(220, 40, 30))
    draw.rectangle((width * 0.5, height * 0.4, width * 0.9, height * 0.9), fill=(20, 200, 90))
    return image


def with_alpha(image: Image.Image) -> Image.Image:
    rgba = np.array(image.convert("RGBA"))
    rgba[: rgba.shape[0] // 3, :, 3] = 0
    rgba[rgba.shape[0] // 3: 2 * rgba.shape[0] // 3, :, 3] = 100
    return Image.fromarray(rgba)


def assert_matches_reference(ours: ImageProcessor, result: ProcessedImage, pil_image) -> None:
    # transformers gets the RGB image (its own RGB rule changed in 5.2x; white_background_rgb is ours)
    expected = transformers_image_processor(ours)(white_background_rgb(pil_image), return_tensors="pt")
    assert result.grid_thw == tuple(expected["image_grid_thw"][0].tolist())
    assert result.pixel_values.dtype == torch.float32
    assert result.pixel_values.is_contiguous()
    assert result.pixel_values.shape == expected["pixel_values"].shape
    diff = (result.pixel_values - expected["pixel_values"]).abs().max().item()
    assert diff <= TOLERANCE, f"max abs diff {diff}"
    _, grid_h, grid_w = result.grid_thw
    assert result.num_tokens == grid_h * grid_w // ours.merge_size**2


IMAGES = {
    "jpeg_1000_square": lambda: encode(photo(1000, 1000), "JPEG", quality=90),
    "jpeg_480x640": lambda: encode(photo(480, 640, seed=1), "JPEG", quality=90),
    "png_640x480": lambda: encode(photo(640, 480, seed=2), "PNG"),
    "jpeg_tiny_20x30": lambda: encode(photo(20, 30, seed=3), "JPEG", quality=95),
    "png_1x1": lambda: encode(Image.new("RGB", (1, 1), (200, 10, 90)), "PNG"),
    "png_elongated_37x1200": lambda: encode(photo(37, 1200, seed=4), "PNG"),
    "png_ratio_199_tall": lambda: encode(photo(995, 5, seed=5), "PNG"),
    "png_rgba": lambda: encode(with_alpha(photo(90, 120, seed=6)), "PNG"),
    "png_palette": lambda: encode(photo(100, 80, seed=7).quantize(colors=64), "PNG"),
    "png_grey": lambda: encode(photo(70, 90, seed=8).convert("L"), "PNG"),
    "jpeg_cmyk": lambda: encode(photo(64, 96, seed=9).convert("CMYK"), "JPEG", quality=90),
    "gif": lambda: encode(photo(60, 75, seed=10).quantize(colors=32), "GIF"),
    "webp": lambda: encode(photo(120, 100, seed=11), "WEBP", quality=85),
    "webp_rgba": lambda: encode(with_alpha(photo(64, 64, seed=12)), "WEBP", lossless=True),
}


@pytest.fixture(scope="module")
def image_bytes() -> dict[str, bytes]:
    return {name: make() for name, make in IMAGES.items()}


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_qwen3_vl_equals_transformers(name: str, image_bytes: dict[str, bytes]) -> None:
    raw = image_bytes[name]
    result = QWEN3_VL.process(raw)
    assert_matches_reference(QWEN3_VL, result, Image.open(io.BytesIO(raw)))


@pytest.mark.parametrize("name", ["jpeg_480x640", "png_640x480", "jpeg_tiny_20x30",
                                  "png_elongated_37x1200", "png_rgba", "jpeg_cmyk", "gif"])
def test_qwen2_vl_style_config_is_honoured(name: str, image_bytes: dict[str, bytes]) -> None:
    raw = image_bytes[name]
    result = QWEN2_VL_STYLE.process(raw)
    assert result.pixel_values.shape[1] == 3 * 2 * 14 * 14
    assert_matches_reference(QWEN2_VL_STYLE, result, Image.open(io.BytesIO(raw)))


def test_qwen2_vl_style_downscales_to_max_pixels(image_bytes: dict[str, bytes]) -> None:
    result = QWEN2_VL_STYLE.process(image_bytes["jpeg_480x640"])
    _, grid_h, grid_w = result.grid_thw
    assert grid_h * grid_w * 14 * 14 <= QWEN2_VL_STYLE.max_pixels < 480 * 640


def test_pil_input_equals_transformers() -> None:
    image = with_alpha(photo(50, 70, seed=13))
    assert_matches_reference(QWEN3_VL, QWEN3_VL.process(image), image)


def test_data_uri_input_equals_bytes_input(image_bytes: dict[str, bytes]) -> None:
    raw = image_bytes["jpeg_480x640"]
    uri = "data:image/JPEG;base64," + base64.b64encode(raw).decode("ascii")
    from_bytes, from_uri = QWEN3_VL.process(raw), QWEN3_VL.process(uri)
    assert torch.equal(from_bytes.pixel_values, from_uri.pixel_values)
    assert from_bytes.content_hash == from_uri.content_hash


def test_patch_layout_is_merge_block_major() -> None:
    """Row r, column c of pixel_values against an explicit loop over the grid."""
    ours = ImageProcessor(min_pixels=64 * 96, max_pixels=64 * 96)
    image = photo(64, 96, seed=14)  # exactly 2 x 3 merge blocks: no resize
    result = ours.process(image)
    assert result.grid_thw == (1, 4, 6)
    normalised = (np.asarray(image, dtype=np.float64) / 255 - 0.5) / 0.5  # [H, W, C]
    p, m = 16, 2
    row = 0
    for block_row in range(2):
        for block_col in range(3):
            for i in range(m):
                for j in range(m):
                    top, left = (block_row * m + i) * p, (block_col * m + j) * p
                    patch = normalised[top:top + p, left:left + p].transpose(2, 0, 1)  # [C, p, p]
                    expected = np.repeat(patch[:, None], 2, axis=1).reshape(-1)  # [C, T, p, p]
                    got = result.pixel_values[row].numpy()
                    np.testing.assert_allclose(got, expected, atol=1e-6)
                    row += 1


def test_patch_reorder_moves_bytes_untouched() -> None:
    """Rows are moved as opaque 16-byte items; bit patterns that would be NaNs
    (signalling or quiet) as float64/complex128 must come through unchanged."""
    ours = ImageProcessor(min_pixels=32 * 64, max_pixels=32 * 64)
    pixels = np.full((32, 64, 3), 1, dtype=np.uint8)
    pixels[:, 6::8] = 0xF4  # little-endian float64 high bytes 0x7FF4...: signalling NaN
    pixels[:, 7::8] = 0x7F
    pixels[::2, 6::8] = 0xF8  # quiet NaN on even rows
    pixels[1::4, 7::8] = 0xFF  # negative NaN
    result = ours.process(Image.fromarray(pixels))
    assert_matches_reference(ours, result, Image.fromarray(pixels))


@pytest.mark.parametrize("name", ["jpeg_480x640", "png_grey", "jpeg_tiny_20x30", "png_640x480"])
def test_process_bytes_normalised_anywhere_equals_process(name: str, image_bytes: dict[str, bytes],
                                                           monkeypatch) -> None:
    """The uint8 rows the engine copies to the GPU, normalised in cache-sized blocks (CPU) or in
    one pass (any other device), are exactly what process() gives, bit for bit."""
    from vlm_catalog.preprocess import image as image_module

    processed = QWEN3_VL.process(image_bytes[name])
    raw = QWEN3_VL.process_bytes(image_bytes[name])
    assert raw.pixel_values.dtype == torch.uint8 and raw.pixel_values.shape == processed.pixel_values.shape
    assert (raw.grid_thw, raw.num_tokens, raw.content_hash) == (
        processed.grid_thw, processed.num_tokens, processed.content_hash)
    for block_bytes in (image_module._BLOCK_BYTES, 1536 * 4 * 3, 2**40):  # the default blocks, 3 rows, all
        monkeypatch.setattr(image_module, "_BLOCK_BYTES", block_bytes)
        got = image_module.normalise_patch_bytes(raw.pixel_values, *QWEN3_VL.normalisation)
        assert got.dtype == torch.float32 and torch.equal(got, processed.pixel_values)
        empty = image_module.normalise_patch_bytes(raw.pixel_values[:0], *QWEN3_VL.normalisation)
        assert empty.shape == (0, raw.pixel_values.shape[1]) and empty.dtype == torch.float32


# ----------------------------------------------------------------- hashing
def test_content_hash_distinguishes_images_and_is_stable(image_bytes: dict[str, bytes]) -> None:
    first = QWEN3_VL.process(image_bytes["png_grey"]).content_hash
    assert first == QWEN3_VL.process(image_bytes["png_grey"]).content_hash
    assert first != QWEN3_VL.process(image_bytes["png_palette"]).content_hash
    assert len(first) == 32 and int(first, 16) >= 0


def test_pil_hash_is_of_pixels_and_differs_from_file_hash(image_bytes: dict[str, bytes]) -> None:
    raw = image_bytes["png_640x480"]
    pil_hash = QWEN3_VL.process(Image.open(io.BytesIO(raw))).content_hash
    assert pil_hash == QWEN3_VL.process(Image.open(io.BytesIO(raw)).convert("RGB")).content_hash
    assert pil_hash != QWEN3_VL.process(raw).content_hash


# ----------------------------------------------------------------- batching
def test_process_many_equals_process_in_order(image_bytes: dict[str, bytes]) -> None:
    names = ["jpeg_480x640", "png_grey", "jpeg_tiny_20x30", "webp", "png_640x480", "gif"]
    inputs = [image_bytes[name] for name in names] + [photo(40, 50, seed=15)]
    singles = [QWEN3_VL.process(item) for item in inputs]
    for workers in (None, 1, 3):
        batch = QWEN3_VL.process_many(inputs, num_workers=workers)
        assert len(batch) == len(inputs)
        for single, batched in zip(singles, batch, strict=True):
            assert batched.grid_thw == single.grid_thw
            assert batched.content_hash == single.content_hash
            assert torch.equal(batched.pixel_values, single.pixel_values)


def test_process_many_reports_which_image_failed(image_bytes: dict[str, bytes]) -> None:
    inputs = [image_bytes["png_grey"], b"not an image", image_bytes["gif"]]
    with pytest.raises(ImageDecodeError) as caught:
        QWEN3_VL.process_many(inputs, num_workers=2)
    assert caught.value.reason is DecodeFailure.NOT_AN_IMAGE
    assert any("image 1 of 3" in note for note in caught.value.__notes__)


def test_process_many_empty_and_bad_worker_count() -> None:
    assert QWEN3_VL.process_many([]) == []
    with pytest.raises(ValueError, match="num_workers"):
        QWEN3_VL.process_many([b"x"], num_workers=0)


# ----------------------------------------------------------------- errors
def test_aspect_ratio_over_200_is_refused() -> None:
    with pytest.raises(ImageDecodeError, match="aspect ratio") as caught:  # the image's fault, tagged as such
        QWEN3_VL.process(Image.new("RGB", (201, 1)))
    assert caught.value.reason is DecodeFailure.ASPECT_RATIO


def test_input_over_decode_limit_is_refused() -> None:
    small_limit = ImageProcessor(max_decode_pixels=1000)
    with pytest.raises(ImageDecodeError) as caught:
        small_limit.process(encode(photo(40, 30), "PNG"))
    assert caught.value.reason is DecodeFailure.TOO_LARGE
    with pytest.raises(ImageDecodeError):
        small_limit.process(photo(40, 30))  # PIL input too


# ----------------------------------------------------------------- smart_resize
def test_smart_resize_matches_transformers_on_random_sizes() -> None:
    rng = random.Random(0)
    settings = [(32, 65_536, 16_777_216), (28, 3136, 1_003_520), (28, 56 * 56, 160_000),
                (32, 256 * 32 * 32, 1280 * 32 * 32)]
    for _ in range(3000):
        factor, min_pixels, max_pixels = rng.choice(settings)
        height = rng.choice([rng.randint(1, 64), rng.randint(1, 5000), rng.randint(1000, 20000)])
        width = max(1, min(int(height * rng.uniform(1 / 150, 150)), 40000))
        ours = smart_resize(height, width, factor, min_pixels, max_pixels)
        expected = transformers_smart_resize(height, width, factor, min_pixels, max_pixels)
        assert ours == expected, (height, width, factor, min_pixels, max_pixels)


@pytest.mark.parametrize("height, width, expected", [
    (1000, 1000, (992, 992)),  # round to nearest multiple of 32
    (48, 48, (256, 256)),  # ties go to even (1.5 -> 2) then min_pixels grows it
    (16, 16, (256, 256)),  # rounds to 0, grown to the 65536-pixel minimum
    (1, 1, (256, 256)),
    (5000, 5000, (4096, 4096)),  # exactly at max_pixels: 4096^2 = 16777216
    (5000, 5001, (4064, 4096)),  # just over: floor after shrinking
    (1, 200, (32, 3648)),  # aspect ratio 200 is allowed; grown, rounded up
])
def test_smart_resize_edges(height: int, width: int, expected: tuple[int, int]) -> None:
    assert smart_resize(height, width, 32, 65_536, 16_777_216) == expected
    assert transformers_smart_resize(height, width, 32, 65_536, 16_777_216) == expected


def test_smart_resize_refusals() -> None:
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        smart_resize(1, 201, 32, 65_536, 16_777_216)
    with pytest.raises(ValueError, match="positive"):
        smart_resize(0, 10, 32, 65_536, 16_777_216)
    with pytest.raises(ValueError, match="factor"):
        smart_resize(10, 10, 0, 65_536, 16_777_216)


def test_size_helpers_agree_with_process() -> None:
    image = photo(300, 451, seed=16)
    result = QWEN3_VL.process(image)
    assert QWEN3_VL.grid_thw_for_size(300, 451) == result.grid_thw
    assert QWEN3_VL.num_tokens_for_size(300, 451) == result.num_tokens
    assert result.num_tokens == math.prod(result.grid_thw) // 4


# ----------------------------------------------------------------- config
QWEN3_VL_CONFIG = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "do_rescale": True, "rescale_factor": 0.00392156862745098, "do_normalize": True,
    "do_convert_rgb": True, "resample": 3,
    "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
}
QWEN2_VL_CONFIG = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": OPENAI_CLIP_MEAN, "image_std": OPENAI_CLIP_STD,
    "image_processor_type": "Qwen2VLImageProcessor",
}


def test_from_config_qwen3_vl_size_form() -> None:
    assert ImageProcessor.from_config(QWEN3_VL_CONFIG) == ImageProcessor()


def test_from_config_qwen2_vl_min_max_pixels_form() -> None:
    processor = ImageProcessor.from_config(QWEN2_VL_CONFIG)
    assert processor.patch_size == 14
    assert (processor.min_pixels, processor.max_pixels) == (3136, 12845056)
    assert processor.image_mean == tuple(OPENAI_CLIP_MEAN)


def test_from_config_top_level_pixels_override_size_and_overrides_win() -> None:
    config = dict(QWEN3_VL_CONFIG, min_pixels=1024, max_pixels=2_000_000)
    processor = ImageProcessor.from_config(config, max_decode_pixels=123_456)
    assert (processor.min_pixels, processor.max_pixels) == (1024, 2_000_000)
    assert processor.max_decode_pixels == 123_456


def test_from_pretrained_reads_preprocessor_config(tmp_path) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(QWEN2_VL_CONFIG))
    assert ImageProcessor.from_pretrained(tmp_path) == ImageProcessor.from_config(QWEN2_VL_CONFIG)


def test_from_pretrained_missing_or_broken_file(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="preprocessor_config.json"):
        ImageProcessor.from_pretrained(tmp_path)
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ImageProcessor.from_pretrained(tmp_path)


def test_size_bounds_may_come_half_from_size_half_from_the_top_level() -> None:
    """transformers reads this; before, refused for the size dict's missing bound."""
    config = {**QWEN3_VL_CONFIG, "size": {"shortest_edge": 4096}, "max_pixels": 200_000}
    ours = ImageProcessor.from_config(config)
    assert (ours.min_pixels, ours.max_pixels) == (4096, 200_000)
    theirs = transformers_pil_image_processor_class()(**{k: v for k, v in config.items() if k != "processor_class"})
    image = photo(700, 1100, seed=3)
    assert ours.process(image).grid_thw == tuple(theirs(images=[image], return_tensors="pt")["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("left_out", [("patch_size",), ("image_mean", "image_std"), ("size",)])
def test_a_config_leaving_a_setting_to_transformers_qwen2_vl_default_is_refused(left_out: tuple[str, ...]) -> None:
    """transformers fills a missing key with Qwen2-VL's value, we with Qwen3-VL's: before, the two
    made other grids from one config (e.g. 1x124x188 patches against 1x50x76) without a word."""
    config = {key: value for key, value in QWEN3_VL_CONFIG.items() if key not in left_out}
    theirs = transformers_pil_image_processor_class()(**{k: v for k, v in config.items() if k != "processor_class"})
    qwen2_vl_defaults = {"patch_size": 14, "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD),
                         "size": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280}}
    for key in left_out:  # what the message says transformers takes
        value = getattr(theirs, key)
        assert (dict(value) if key == "size" else list(value) if key.startswith("image_") else value) == qwen2_vl_defaults[key], key
    named = ["min_pixels", "max_pixels"] if left_out == ("size",) else list(left_out)
    with pytest.raises(ValueError, match=f"config gives no {', '.join(named)}: transformers would take Qwen2-VL's"):
        ImageProcessor.from_config(config)


@pytest.mark.parametrize("bad, match", [
    ({"do_normalize": False}, "do_normalize"),
    ({"do_center_crop": True}, "do_center_crop"),
    ({"size": {"shortest_edge": 100}}, "longest_edge"),
    ({"size": 448}, "must be a dict"),
    ({"image_std": [0.5, 0.0, 0.5]}, "must not contain 0"),
    ({"image_mean": [0.5, 0.5]}, "3 values"),
    ({"patch_size": 0}, "patch_size"),
    ({"min_pixels": 10_000, "max_pixels": 100}, "must not exceed"),
    ({"resample": 99}, "resample"),
])
def test_from_config_refusals(bad: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ImageProcessor.from_config(dict(QWEN3_VL_CONFIG, **bad))
