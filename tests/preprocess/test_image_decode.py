"""decode_image: formats, data URIs, EXIF orientation, the RGB rule, and every refusal."""

from __future__ import annotations

import base64
import inspect
import io
import struct
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from tests.conftest import png_bomb
from vlm_catalog.bench.baselines import white_background_rgb
from vlm_catalog.preprocess.image_decode import (
    DEFAULT_MAX_DECODE_PIXELS,
    DecodeFailure,
    ImageDecodeError,
    decode_image,
    decode_image_bytes,
    probe_image_bytes,
    to_rgb,
)

LIMIT = 10_000_000


def encode(image: Image.Image, fmt: str, **save_args) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **save_args)
    return buffer.getvalue()


def noisy_rgb(height: int, width: int, seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_uri(raw: bytes, media_type: str = "image/jpeg") -> str:
    return f"data:{media_type};base64," + base64.b64encode(raw).decode("ascii")


def png_chunk(kind: bytes, payload: bytes) -> bytes:
    crc = zlib.crc32(kind + payload) & 0xFFFFFFFF
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", crc)


def png_with_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height, with (almost) no pixel data."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + png_chunk(b"IEND", b""))


def png_rgb16(height: int = 12, width: int = 10) -> bytes:
    """A 16-bit-per-channel RGB PNG (PIL cannot write one), samples big-endian."""
    rng = np.random.default_rng(4)
    samples = rng.integers(0, 65536, (height, width, 3), dtype=np.uint16).astype(">u2")
    rows = b"".join(b"\x00" + row.tobytes() for row in samples)  # filter 0 per row
    header = struct.pack(">IIBBBBB", width, height, 16, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", header)
            + png_chunk(b"IDAT", zlib.compress(rows)) + png_chunk(b"IEND", b""))


def transformers_rgb(raw: bytes) -> np.ndarray:
    """What transformers' processors work on: PIL's decode with transparency composited onto
    white (`white_background_rgb`). Where the installed transformers has that rule
    (`convert_to_rgb(..., return_numpy=True)`, 5.2x on), it must agree; older ones drop alpha."""
    expected = np.asarray(white_background_rgb(Image.open(io.BytesIO(raw))))
    if "return_numpy" in inspect.signature(convert_to_rgb).parameters:
        np.testing.assert_array_equal(convert_to_rgb(Image.open(io.BytesIO(raw)), return_numpy=True), expected)
    return expected


def assert_reason(raw: bytes | str, reason: DecodeFailure, max_pixels: int = LIMIT) -> str:
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(raw, max_pixels=max_pixels)
    assert caught.value.reason is reason, str(caught.value)
    assert isinstance(caught.value, ValueError)
    return str(caught.value)


# ------------------------------------------------------------------ formats
def _rgba_with_transparency() -> Image.Image:
    rgba = np.array(noisy_rgb(24, 40, seed=1).convert("RGBA"))
    rgba[:, :10, 3] = 0  # fully transparent strip
    rgba[:, 10:20, 3] = 128  # half transparent strip
    return Image.fromarray(rgba)


def _palette_with_transparency() -> Image.Image:
    palette_image = noisy_rgb(20, 30, seed=2).quantize(colors=16)
    palette_image.info["transparency"] = 3
    return palette_image


def _rgb_with_black_block() -> Image.Image:
    pixels = np.array(noisy_rgb(12, 16, seed=3))
    pixels[2:6, 3:9] = 0  # the colour a tRNS chunk will mark transparent
    return Image.fromarray(pixels)


def _grey16() -> Image.Image:
    ramp = (np.arange(32 * 48, dtype=np.uint16).reshape(32, 48) * 40)
    return Image.fromarray(ramp)  # mode I;16


CASES = {
    "jpeg_rgb": lambda: encode(noisy_rgb(30, 50), "JPEG", quality=90),
    "jpeg_grey": lambda: encode(noisy_rgb(30, 50).convert("L"), "JPEG"),
    "jpeg_cmyk": lambda: encode(noisy_rgb(30, 50).convert("CMYK"), "JPEG"),
    "png_rgb": lambda: encode(noisy_rgb(17, 23), "PNG"),
    "png_rgba": lambda: encode(_rgba_with_transparency(), "PNG"),
    "png_rgb_transparent_colour": lambda: encode(
        _rgb_with_black_block(), "PNG", transparency=(0, 0, 0)),
    "png_la": lambda: encode(_rgba_with_transparency().convert("LA"), "PNG"),
    "png_palette": lambda: encode(noisy_rgb(20, 30).quantize(colors=32), "PNG"),
    "png_palette_transparent": lambda: encode(_palette_with_transparency(), "PNG"),
    "png_grey": lambda: encode(noisy_rgb(20, 30).convert("L"), "PNG"),
    "png_grey16": lambda: encode(_grey16(), "PNG"),
    "png_rgb16": png_rgb16,
    "png_bilevel": lambda: encode(noisy_rgb(20, 30).convert("1"), "PNG"),
    "gif": lambda: encode(_palette_with_transparency(), "GIF"),
    "webp_lossy": lambda: encode(noisy_rgb(30, 40), "WEBP", quality=80),
    "webp_lossless_rgba": lambda: encode(_rgba_with_transparency(), "WEBP", lossless=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_rgb_rule_equals_transformers(name: str) -> None:
    raw = CASES[name]()
    decoded = decode_image(raw, max_pixels=LIMIT)
    assert decoded.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(decoded), transformers_rgb(raw))


def test_transparency_is_flattened_onto_white() -> None:
    decoded = np.asarray(decode_image(CASES["png_rgba"](), max_pixels=LIMIT))
    assert (decoded[:, :10] == 255).all()  # fully transparent -> white
    original = np.asarray(_rgba_with_transparency())[:, 10:20, :3].astype(int)
    expected = (original * 128 + 255 * 127 + 127) // 255  # alpha 128 over white
    assert np.abs(decoded[:, 10:20].astype(int) - expected).max() <= 1


def test_rgb_png_transparent_colour_becomes_white() -> None:
    raw = CASES["png_rgb_transparent_colour"]()
    assert Image.open(io.BytesIO(raw)).info.get("transparency") == (0, 0, 0)
    decoded = np.asarray(decode_image(raw, max_pixels=LIMIT))
    assert (decoded[2:6, 3:9] == 255).all()


def test_gif_decodes_the_first_frame() -> None:
    frames = [Image.new("RGB", (16, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    raw = encode(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=100)
    assert Image.open(io.BytesIO(raw)).n_frames == 2
    decoded = np.asarray(decode_image(raw, max_pixels=LIMIT))
    assert (decoded == (255, 0, 0)).all()


def test_already_rgb_image_is_not_copied_or_changed() -> None:
    raw = CASES["jpeg_rgb"]()
    np.testing.assert_array_equal(
        np.asarray(decode_image(raw, max_pixels=LIMIT)), np.asarray(Image.open(io.BytesIO(raw)))
    )


# ------------------------------------------------------------------ data URIs
@pytest.mark.parametrize("media_type", ["image/jpeg", "image/JPEG", "IMAGE/Jpg"])
def test_data_uri_equals_raw_bytes(media_type: str) -> None:
    raw = CASES["jpeg_rgb"]()
    from_uri = decode_image(data_uri(raw, media_type), max_pixels=LIMIT)
    from_bytes = decode_image(raw, max_pixels=LIMIT)
    np.testing.assert_array_equal(np.asarray(from_uri), np.asarray(from_bytes))


def test_data_uri_with_parameters_and_wrapped_base64() -> None:
    raw = CASES["png_rgb"]()
    payload = base64.encodebytes(raw).decode("ascii")  # wrapped at 76 columns
    uri = "data:image/png;name=photo.png;base64," + payload
    decoded = decode_image(uri, max_pixels=LIMIT)
    np.testing.assert_array_equal(np.asarray(decoded), transformers_rgb(raw))


def test_data_uri_is_identified_by_content_not_declared_type() -> None:
    raw = CASES["png_rgb"]()  # declared as JPEG, really PNG
    decoded = decode_image(data_uri(raw, "image/jpeg"), max_pixels=LIMIT)
    np.testing.assert_array_equal(np.asarray(decoded), transformers_rgb(raw))


# ------------------------------------------------------------------ EXIF
def test_exif_orientation_6_rotates_clockwise() -> None:
    stored = np.zeros((32, 64, 3), dtype=np.uint8)  # 64 wide, 32 high as stored
    stored[:, :32] = (255, 0, 0)  # left half red
    stored[:, 32:] = (0, 0, 255)  # right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    raw = encode(Image.fromarray(stored), "JPEG", quality=100, exif=exif.tobytes())

    decoded = decode_image(raw, max_pixels=LIMIT)
    assert decoded.size == (32, 64)  # (width, height): now portrait
    pixels = np.asarray(decoded).astype(int)
    assert (np.abs(pixels[:28] - (255, 0, 0)) < 40).all()  # left side is now on top
    assert (np.abs(pixels[36:] - (0, 0, 255)) < 40).all()
    as_stored = np.asarray(Image.open(io.BytesIO(raw)))
    np.testing.assert_array_equal(pixels, np.rot90(as_stored, k=-1))  # exact clockwise turn


def _exif_block(entries: list[tuple[int, int, int, bytes]]) -> bytes:
    """An APP1 EXIF block of one little-endian IFD: (tag, TIFF type, count, value bytes)."""
    header = b"II*\x00" + struct.pack("<I", 8)
    data_offset = 8 + 2 + 12 * len(entries) + 4
    ifd, data = struct.pack("<H", len(entries)), b""
    for tag, kind, count, value in entries:
        if len(value) > 4:  # stored after the IFD, by offset
            ifd += struct.pack("<HHII", tag, kind, count, data_offset + len(data))
            data += value
        else:
            ifd += struct.pack("<HHI", tag, kind, count) + value.ljust(4, b"\x00")
    return b"Exif\x00\x00" + header + ifd + struct.pack("<I", 0) + data


@pytest.mark.parametrize("orientation", range(1, 9))
def test_every_exif_orientation_turns_as_pil_exif_transpose(orientation: int) -> None:
    from PIL import ImageOps

    exif = Image.Exif()
    exif[0x0112] = orientation
    raw = encode(noisy_rgb(24, 40), "PNG", exif=exif.tobytes())
    expected = ImageOps.exif_transpose(Image.open(io.BytesIO(raw)))
    np.testing.assert_array_equal(np.asarray(decode_image(raw, max_pixels=LIMIT)), np.asarray(expected))


def test_a_damaged_exif_tag_beside_the_orientation_does_not_stop_the_decode() -> None:
    """XResolution (a rational) stored as text: PIL's exif_transpose, which writes the EXIF block
    again, raised TypeError there, past the probe, failing the record as an engine error."""
    block = _exif_block([(0x0112, 3, 1, struct.pack("<H", 6)), (0x011A, 2, 8, b"abcdefg\x00")])
    raw = encode(noisy_rgb(16, 32), "JPEG", quality=95, exif=block)
    assert probe_image_bytes(raw, max_pixels=LIMIT) == (16, 32)
    assert decode_image(raw, max_pixels=LIMIT).size == (16, 32)  # turned upright, as the probe said


def test_a_multi_picture_jpeg_data_uri_as_the_reference_names_it() -> None:
    """PIL calls a phone camera's multi-picture JPEG "MPO", so the reference harness (and our
    image_data_uri) send data:image/MPO: before, refused as an unsupported media type."""
    buffer = io.BytesIO()
    noisy_rgb(24, 32).save(buffer, "MPO", save_all=True, append_images=[Image.new("RGB", (8, 8))])
    raw = buffer.getvalue()
    decoded = decode_image(data_uri(raw, "image/MPO"), max_pixels=LIMIT)
    np.testing.assert_array_equal(np.asarray(decoded), transformers_rgb(raw))


# ------------------------------------------------------------------ refusals
def test_empty_input() -> None:
    assert_reason(b"", DecodeFailure.EMPTY)
    assert_reason("data:image/png;base64,", DecodeFailure.EMPTY)


def test_garbage_bytes() -> None:
    message = assert_reason(b"this is not an image at all", DecodeFailure.NOT_AN_IMAGE)
    assert "JPEG, PNG, WebP or GIF" in message


def test_corrupt_header_with_right_magic() -> None:
    message = assert_reason(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40, DecodeFailure.NOT_AN_IMAGE)
    assert message.startswith("cannot read the PNG header") and "BytesIO" not in message  # no object repr


def test_truncated_jpeg() -> None:
    raw = encode(noisy_rgb(64, 64), "JPEG", quality=90)
    message = assert_reason(raw[: len(raw) // 2], DecodeFailure.TRUNCATED)
    assert "truncated" in message


def test_truncated_png() -> None:
    assert_reason(png_with_header_only(100, 100), DecodeFailure.TRUNCATED)


@pytest.mark.parametrize("uri", [
    "https://example.com/cat.jpg",
    "/tmp/cat.jpg",
    "data:image/png,rawdata-not-base64",
    "data:image/png;base64",  # no comma
])
def test_bad_data_uri(uri: str) -> None:
    assert_reason(uri, DecodeFailure.BAD_DATA_URI)


def test_bad_base64() -> None:
    message = assert_reason("data:image/jpeg;base64,@@not*base64!!", DecodeFailure.BAD_BASE64)
    assert "base64" in message


def test_unsupported_declared_type() -> None:
    assert_reason(data_uri(b"II*\x00....", "image/tiff"), DecodeFailure.UNSUPPORTED_FORMAT)


@pytest.mark.parametrize("fmt", ["BMP", "TIFF"])
def test_unsupported_formats_are_named(fmt: str) -> None:
    message = assert_reason(encode(noisy_rgb(8, 8), fmt), DecodeFailure.UNSUPPORTED_FORMAT)
    assert fmt in message


def test_zero_size_header() -> None:
    assert_reason(png_with_header_only(0, 10), DecodeFailure.ZERO_SIZE)


def test_over_the_configured_limit_is_refused_not_downscaled() -> None:
    raw = encode(noisy_rgb(20, 30), "PNG")
    message = assert_reason(raw, DecodeFailure.TOO_LARGE, max_pixels=599)
    assert "600" in message and "599" in message
    assert decode_image(raw, max_pixels=600).size == (30, 20)


PIL_DEFAULT_MAX_IMAGE_PIXELS = 1024 * 1024 * 1024 // 4 // 3


def test_bomb_header_40000_squared_is_refused_before_decoding(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PIL_DEFAULT_MAX_IMAGE_PIXELS)
    raw = png_with_header_only(40_000, 40_000)  # 1.6 G pixels, a few dozen bytes
    with pytest.raises(ImageDecodeError) as caught:
        decode_image(raw, max_pixels=LIMIT)
    # PIL's own guard fires inside Image.open, before our limit check.
    assert caught.value.reason in (DecodeFailure.DECOMPRESSION_BOMB, DecodeFailure.TOO_LARGE)
    # Even a caller who raises our limit cannot get past PIL's guard.
    assert_reason(raw, DecodeFailure.DECOMPRESSION_BOMB, max_pixels=4_000_000_000)


def test_pil_bomb_warning_becomes_an_error_and_is_not_emitted(monkeypatch) -> None:
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", PIL_DEFAULT_MAX_IMAGE_PIXELS)
    raw = png_with_header_only(10_000, 10_000)  # over PIL's warning level only
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning that escapes fails the test
        assert_reason(raw, DecodeFailure.DECOMPRESSION_BOMB, max_pixels=200_000_000)


def test_our_limit_applies_before_pil_limits() -> None:
    assert_reason(png_with_header_only(3000, 3000), DecodeFailure.TOO_LARGE, max_pixels=1_000_000)


def test_wrong_input_type_is_a_decode_error_naming_the_type() -> None:
    # a ValueError like every other bad image, so the offline API fails only that prompt
    with pytest.raises(ImageDecodeError, match="got int") as caught:
        decode_image(12345, max_pixels=LIMIT)  # type: ignore[arg-type]
    assert caught.value.reason is DecodeFailure.UNSUPPORTED_INPUT
    with pytest.raises(ImageDecodeError, match="got PosixPath .files are not read") as caught:
        decode_image(Path("photo.jpg"), max_pixels=LIMIT)  # type: ignore[arg-type]
    assert caught.value.reason is DecodeFailure.UNSUPPORTED_INPUT


def test_a_pil_image_whose_file_closed_is_a_decode_error(tmp_path) -> None:
    path = tmp_path / "photo.png"
    path.write_bytes(CASES["png_rgb"]())
    with Image.open(path) as lazy:  # opened lazily: the pixels are read on first use, after the close
        pass
    with pytest.raises(ImageDecodeError, match="cannot be loaded") as caught:
        to_rgb(lazy)
    assert caught.value.reason is DecodeFailure.UNREADABLE_PIXELS


def test_non_positive_limit() -> None:
    with pytest.raises(ValueError, match="max_pixels"):
        decode_image(CASES["png_rgb"](), max_pixels=0)


def test_text_html_and_svg_are_named() -> None:
    assert "is text" in assert_reason(b"this is not an image at all", DecodeFailure.NOT_AN_IMAGE)
    assert "HTML document" in assert_reason(b"\n<!DOCTYPE html><html><body>404</body></html>", DecodeFailure.NOT_AN_IMAGE)
    assert "SVG" in assert_reason(b'  <svg xmlns="http://www.w3.org/2000/svg"/>', DecodeFailure.UNSUPPORTED_FORMAT)
    assert "SVG" in assert_reason(b'\xef\xbb\xbf<?xml version="1.0"?>\n<svg/>', DecodeFailure.UNSUPPORTED_FORMAT)


def test_tiny_png_claiming_a_huge_size_is_refused_from_its_header() -> None:
    """69 bytes claiming 100000 x 100000 pixels: refused without decoding, never PIL's raw error."""
    bomb = png_bomb()
    assert len(bomb) < 80
    for function in (probe_image_bytes, decode_image_bytes):
        with pytest.raises(ImageDecodeError) as raised:
            function(bomb, max_pixels=DEFAULT_MAX_DECODE_PIXELS)
        assert raised.value.reason in (DecodeFailure.DECOMPRESSION_BOMB, DecodeFailure.TOO_LARGE)


def test_probe_of_a_png_reads_its_pixels_only_where_an_orientation_may_follow_them(monkeypatch) -> None:
    """Before, PIL's getexif decoded every PNG's pixels in the header-only probe (1.6 s for 49 MP),
    and the engine decoded them again."""
    from PIL import PngImagePlugin

    plain = encode(noisy_rgb(40, 30), "PNG")
    end = plain.rindex(b"IEND") - 4  # where the IEND chunk starts
    exif = Image.Exif()
    exif[0x0112] = 6
    late_exif = plain[:end] + png_chunk(b"eXIf", exif.tobytes()) + plain[end:]  # after IDAT
    decoded = []
    real_load = PngImagePlugin.PngImageFile.load
    monkeypatch.setattr(PngImagePlugin.PngImageFile, "load", lambda image: decoded.append(1) or real_load(image))
    assert probe_image_bytes(plain, max_pixels=LIMIT) == (30, 40) and not decoded
    assert probe_image_bytes(late_exif, max_pixels=LIMIT) == (40, 30) and decoded  # turned, as the decode turns it
    assert decode_image_bytes(late_exif, max_pixels=LIMIT).size == (40, 30)


def test_probe_of_a_png_cut_in_its_pixel_data_is_a_decode_error() -> None:
    """PIL reads a PNG's pixel data to look for EXIF after it: the cut shows in the probe, as our error."""
    raw = encode(noisy_rgb(120, 90), "PNG")
    with pytest.raises(ImageDecodeError) as raised:
        probe_image_bytes(raw[:-40], max_pixels=LIMIT)
    assert raised.value.reason is DecodeFailure.TRUNCATED
