"""Turn untrusted image bytes (or a ``data:`` URI) into an RGB ``PIL.Image``.

Accepted containers: JPEG (and its multi-picture variant MPO), PNG, WebP and GIF
(first frame only). Everything else is refused with an :class:`ImageDecodeError`
whose ``reason`` says why.

Safety rules:

* The pixel count is read from the header (``Image.open`` parses only the header)
  and checked against ``max_pixels`` *before* any pixel is decoded. PIL's own
  decompression-bomb error and warning are turned into the same error.
* An image over the limit is refused, never downscaled to fit (JPEG "draft" mode
  and similar shortcuts would change the pixels the model sees).
* Truncated data is an error (PIL's global ``ImageFile.LOAD_TRUNCATED_IMAGES``
  must stay False, its default, for this to hold).

RGB rule (identical to ``transformers.image_transforms.convert_to_rgb``, so the
pixels equal what transformers' Qwen2-VL PIL processor works on):

* An image "has alpha" when one of its bands is ``"A"`` (RGBA, LA, PA) or when its
  ``info`` carries a ``"transparency"`` entry (palette or greyscale PNG/GIF with a
  transparent index/colour, RGB PNG with a tRNS colour). Such an image is
  converted to RGBA and alpha-composited over an opaque white background, then
  converted to RGB: transparent pixels become white, half-transparent ones are
  blended with white.
* Any other image goes through PIL's ``convert("RGB")``: palette lookup, grey
  replicated to three channels, PIL's naive CMYK->RGB (no colour profile), and
  for 16-bit greyscale ("I;16") PIL's own clipping to 8 bits.
* An image that is already plain RGB is returned as is (no copy).

EXIF orientation (tag 0x0112, values 2..8) is applied, so a portrait photo whose
sensor data is landscape comes out portrait. transformers does not do this; for
images without an orientation tag the two agree exactly.
"""

from __future__ import annotations

import base64
import binascii
import enum
import io
import os
import struct
import threading
import warnings

from PIL import ExifTags, Image, UnidentifiedImageError

__all__ = [
    "DEFAULT_MAX_DECODE_PIXELS",
    "DecodeFailure",
    "check_pixel_limit",
    "ImageDecodeError",
    "decode_image",
    "decode_image_bytes",
    "image_bytes_from_input",
    "probe_image_bytes",
    "to_rgb",
]

# 50 megapixels: far above the benchmark's largest product photo (2000 x 2000 =
# 4 MP) and common camera sizes (24-48 MP), far below what would exhaust memory
# (PIL holds RGB as 4 bytes a pixel: 50 MP = 200 MB).
DEFAULT_MAX_DECODE_PIXELS = 50_000_000


class DecodeFailure(enum.StrEnum):
    """Why an image was refused (the ``reason`` of :class:`ImageDecodeError`)."""

    EMPTY = "empty"  # zero bytes
    BAD_DATA_URI = "bad_data_uri"  # a str that is not a base64 data:image URI
    BAD_BASE64 = "bad_base64"  # the URI's payload is not valid base64
    UNSUPPORTED_FORMAT = "unsupported_format"  # a real image, but not JPEG/PNG/WebP/GIF
    NOT_AN_IMAGE = "not_an_image"  # unrecognised bytes or a corrupt header
    TRUNCATED = "truncated"  # header fine, pixel data cut short or corrupt
    ZERO_SIZE = "zero_size"  # header says width or height is 0
    TOO_LARGE = "too_large"  # header's pixel count over the configured limit
    DECOMPRESSION_BOMB = "decompression_bomb"  # PIL's own bomb guard fired
    UNSUPPORTED_MODE = "unsupported_mode"  # PIL cannot convert this pixel mode to RGB
    UNSUPPORTED_INPUT = "unsupported_input"  # neither bytes, a data URI nor a PIL image (e.g. a path)
    UNREADABLE_PIXELS = "unreadable_pixels"  # a PIL image whose pixels cannot be loaded (its file closed)
    ASPECT_RATIO = "aspect_ratio"  # one side over 200 times the other (transformers' limit)


class ImageDecodeError(ValueError):
    """An input that cannot be turned into an RGB image; ``reason`` says why."""

    def __init__(self, reason: DecodeFailure, message: str) -> None:
        super().__init__(f"{message} [{reason.value}]")
        self.reason = reason


# Magic numbers of the formats we decode, mapped to PIL's format name.
_SUPPORTED_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\xff\xd8\xff", "JPEG"),
    (b"\x89PNG\r\n\x1a\n", "PNG"),
    (b"GIF87a", "GIF"),
    (b"GIF89a", "GIF"),
)
# Magic numbers of common formats we refuse, only to name them in the error.
_UNSUPPORTED_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"BM", "BMP"),
    (b"II*\x00", "TIFF"),
    (b"MM\x00*", "TIFF"),
    (b"\x00\x00\x01\x00", "ICO"),
    (b"8BPS", "PSD"),
    (b"\x00\x00\x00\x0cjP  ", "JPEG 2000"),
    (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"%PDF", "PDF"),
    (b"<svg", "SVG"),
    (b"<?xml", "SVG/XML"),
)
# Formats PIL may report for bytes we sniffed as supported ("MPO": multi-picture
# JPEG from cameras; its first picture is the ordinary JPEG).
_ACCEPTED_PIL_FORMATS = frozenset({"JPEG", "MPO", "PNG", "WEBP", "GIF"})
# Media types allowed in a data URI (lower case), e.g. the MLPerf reference's
# "data:image/JPEG;base64,", which names the type after PIL's format: "image/MPO"
# for a phone camera's multi-picture JPEG.
_DATA_URI_MEDIA_TYPES = frozenset(
    {"image/jpeg", "image/jpg", "image/pjpeg", "image/mpo", "image/png", "image/webp", "image/gif"}
)

# warnings.catch_warnings swaps the process-wide filter list; serialise our own
# uses of it. It guards only Image.open, which parses the header (microseconds).
_WARNINGS_LOCK = threading.Lock()


def image_bytes_from_input(data: bytes | bytearray | memoryview | str) -> bytes:
    """Return the image file's bytes: ``data`` itself, or a data URI's decoded payload.

    A ``str`` must be ``data:image/<fmt>[;param=value...];base64,<payload>`` with
    ``<fmt>`` one of jpeg/jpg/png/webp/gif in any letter case. The declared format
    is only a gate: the bytes are identified by their own magic number. Paths and
    URLs are refused (nothing is read from disk or the network).
    """
    if isinstance(data, str):
        return _decode_data_uri(data)
    if isinstance(data, (bytes, bytearray, memoryview)):
        raw = bytes(data)
        if not raw:
            raise ImageDecodeError(DecodeFailure.EMPTY, "image data is empty (0 bytes)")
        return raw
    raise ImageDecodeError(
        DecodeFailure.UNSUPPORTED_INPUT,
        f"image must be bytes, a PIL image or a data:image/...;base64 URI string, got {type(data).__name__}"
        + (" (files are not read: pass the file's bytes)" if isinstance(data, os.PathLike) else ""),
    )


def _decode_data_uri(uri: str) -> bytes:
    head, comma, payload = uri.partition(",")
    if not head[:5].lower() == "data:" or not comma:
        shown = uri[:40] + ("..." if len(uri) > 40 else "")
        raise ImageDecodeError(
            DecodeFailure.BAD_DATA_URI,
            f"expected a 'data:image/<format>;base64,...' URI, got {shown!r} "
            "(file paths and URLs are not fetched)",
        )
    media_type, *params = head[5:].split(";")
    media_type = media_type.strip().lower()
    if not params or params[-1].strip().lower() != "base64":
        raise ImageDecodeError(
            DecodeFailure.BAD_DATA_URI,
            f"data URI {head!r} is not base64-encoded (expected ';base64,' before the data)",
        )
    if media_type not in _DATA_URI_MEDIA_TYPES:
        raise ImageDecodeError(
            DecodeFailure.UNSUPPORTED_FORMAT,
            f"data URI media type {media_type!r} is not supported "
            f"(use one of {sorted(_DATA_URI_MEDIA_TYPES)})",
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        # Some clients wrap base64 at 76 columns: allow whitespace, nothing else.
        try:
            raw = base64.b64decode("".join(payload.split()), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ImageDecodeError(
                DecodeFailure.BAD_BASE64, f"data URI payload is not valid base64: {exc}"
            ) from None
    if not raw:
        raise ImageDecodeError(DecodeFailure.EMPTY, "data URI carries no image bytes")
    return raw


def _sniff_format(raw: bytes) -> str:
    """PIL format name of ``raw`` from its magic number, or raise."""
    for signature, name in _SUPPORTED_SIGNATURES:
        if raw.startswith(signature):
            return name
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "WEBP"
    for signature, name in _UNSUPPORTED_SIGNATURES:
        if raw.startswith(signature):
            raise ImageDecodeError(
                DecodeFailure.UNSUPPORTED_FORMAT,
                f"{name} images are not supported (use JPEG, PNG, WebP or GIF)",
            )
    if raw[4:8] == b"ftyp":  # ISO-BMFF: HEIC, AVIF
        brand = raw[8:12].decode("ascii", "replace")
        raise ImageDecodeError(
            DecodeFailure.UNSUPPORTED_FORMAT,
            f"ISO-BMFF image (brand {brand!r}, e.g. HEIC/AVIF) is not supported "
            "(use JPEG, PNG, WebP or GIF)",
        )
    markup = raw[:512].lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if markup.startswith((b"<svg", b"<?xml")) and b"<svg" in markup:
        raise ImageDecodeError(
            DecodeFailure.UNSUPPORTED_FORMAT, "SVG images are not supported (use JPEG, PNG, WebP or GIF)"
        )
    if markup.startswith((b"<!doctype html", b"<html", b"<head", b"<body", b"<!--")):
        raise ImageDecodeError(
            DecodeFailure.NOT_AN_IMAGE, f"data is an HTML document, not a JPEG, PNG, WebP or GIF image (starts with {raw[:16]!r})"
        )
    if _looks_like_text(raw[:512]):
        raise ImageDecodeError(
            DecodeFailure.NOT_AN_IMAGE, f"data is text, not a JPEG, PNG, WebP or GIF image (starts with {raw[:16]!r})"
        )
    raise ImageDecodeError(
        DecodeFailure.NOT_AN_IMAGE,
        f"data is not a JPEG, PNG, WebP or GIF image (starts with {raw[:8]!r})",
    )


def _looks_like_text(head: bytes) -> bool:
    """UTF-8 without control characters other than whitespace: no image starts like that."""
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return all(ch.isprintable() or ch in "\t\r\n" for ch in text)


def _declared_size(raw: bytes, fmt: str) -> tuple[int, int] | None:
    """(width, height) from a PNG or GIF header's fixed fields, else None."""
    if fmt == "PNG" and len(raw) >= 24 and raw[12:16] == b"IHDR":
        return int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    if fmt == "GIF" and len(raw) >= 10:
        return int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little")
    return None


def _open_header(raw: bytes, fmt: str) -> Image.Image:
    """``Image.open`` (header only) with PIL's bomb warning raised as an error."""
    try:
        with _WARNINGS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=[fmt])
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageDecodeError(DecodeFailure.DECOMPRESSION_BOMB, str(exc)) from None
    except (UnidentifiedImageError, SyntaxError, OSError, ValueError, EOFError) as exc:
        size = _declared_size(raw, fmt)
        if size is not None and 0 in size:  # PIL refuses these as unidentified
            raise ImageDecodeError(
                DecodeFailure.ZERO_SIZE, f"{fmt} header declares zero size ({size[0]}x{size[1]})"
            ) from None
        if isinstance(exc, UnidentifiedImageError):  # PIL's message names its in-memory file object
            reason = "the data after the signature is not a valid header"
        else:
            reason = str(exc)
        raise ImageDecodeError(
            DecodeFailure.NOT_AN_IMAGE, f"cannot read the {fmt} header: {reason}"
        ) from None
    if image.format not in _ACCEPTED_PIL_FORMATS:  # defensive: formats= should ensure it
        raise ImageDecodeError(
            DecodeFailure.UNSUPPORTED_FORMAT, f"{image.format} images are not supported"
        )
    return image


def check_pixel_limit(width: int, height: int, max_pixels: int) -> None:
    """Raise unless ``width x height`` is a non-empty image of at most ``max_pixels``."""
    if width <= 0 or height <= 0:
        raise ImageDecodeError(DecodeFailure.ZERO_SIZE, f"image has zero size ({width}x{height})")
    if width * height > max_pixels:
        raise ImageDecodeError(
            DecodeFailure.TOO_LARGE,
            f"image is {width}x{height} = {width * height} pixels, over the limit of "
            f"{max_pixels} (images are refused, not downscaled)",
        )


def _load_pixels(image: Image.Image, fmt: str) -> None:
    try:
        image.load()  # for GIF and animated WebP: the first frame only
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(DecodeFailure.DECOMPRESSION_BOMB, str(exc)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageDecodeError(
            DecodeFailure.TRUNCATED, f"{fmt} pixel data is truncated or corrupt: {exc}"
        ) from None


# PNG chunks that may hold the orientation: eXIf, and text (XMP in iTXt, "Raw profile type exif")
_PNG_METADATA_CHUNKS = frozenset({b"eXIf", b"iTXt", b"tEXt", b"zTXt"})


def _png_metadata_past_pixels(raw: bytes) -> bool:
    """Whether a PNG may hold metadata that PIL reads only by decoding the pixels: a metadata chunk
    after the first IDAT, or chunks that cannot be walked to IEND (a file cut short, which the
    decode then reports). Walks the chunk headers only: microseconds, whatever the image's size."""
    position, past_pixels = 8, False  # past the signature
    while position + 8 <= len(raw):
        length, kind = struct.unpack(">I4s", raw[position : position + 8])
        if kind == b"IEND":
            return False
        past_pixels |= kind == b"IDAT"
        if past_pixels and kind in _PNG_METADATA_CHUNKS:
            return True
        position += 12 + length  # length, type, data, CRC
    return True


def _exif_orientation(image: Image.Image, fmt: str, raw: bytes | None = None) -> int:
    """The EXIF orientation tag (1 if none). For a PNG, PIL decodes the pixels to look past
    them for an eXIf chunk; given the file's bytes (`raw`), it does so only where one may be
    (`_png_metadata_past_pixels`), so a file cut short there fails here, as the decode would."""
    header_only = raw is not None and fmt == "PNG" and not _png_metadata_past_pixels(raw)
    try:
        exif = Image.Image.getexif(image) if header_only else image.getexif()  # the first: PIL's, minus load()
        return exif.get(ExifTags.Base.Orientation, 1)
    except Image.DecompressionBombError as exc:
        raise ImageDecodeError(DecodeFailure.DECOMPRESSION_BOMB, str(exc)) from None
    except (OSError, SyntaxError, ValueError, EOFError, struct.error) as exc:
        raise ImageDecodeError(DecodeFailure.TRUNCATED, f"{fmt} data is truncated or corrupt: {exc}") from None


# The flip or rotation that shows a picture upright, by its EXIF orientation (as PIL's exif_transpose)
_ORIENTATION_TRANSPOSE = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


def _apply_exif_orientation(image: Image.Image, fmt: str) -> Image.Image:
    """Rotate/flip as the EXIF orientation tag says (no copy when there is none). The pixels
    of ImageOps.exif_transpose, without its rewrite of the EXIF block, which raises a
    TypeError on some damaged tags that the orientation read passes."""
    method = _ORIENTATION_TRANSPOSE.get(_exif_orientation(image, fmt))
    return image if method is None else image.transpose(method)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB version of ``image`` by transformers' ``convert_to_rgb`` rule (module doc)."""
    try:  # a lazily opened image whose file was closed fails here, not later inside a step
        image.load()
    except Exception as exc:  # PIL raises OSError, ValueError, or an AssertionError on a closed file
        raise ImageDecodeError(
            DecodeFailure.UNREADABLE_PIXELS,
            f"the PIL image's pixels cannot be loaded ({type(exc).__name__}{': ' if str(exc) else ''}{exc}); "
            "was its file closed before they were read? Call image.load() while it is open",
        ) from None
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    try:
        if has_alpha:
            rgba = image.convert("RGBA")
            white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, rgba).convert("RGB")
        if image.mode == "RGB":
            return image
        return image.convert("RGB")
    except (ValueError, OSError) as exc:
        raise ImageDecodeError(
            DecodeFailure.UNSUPPORTED_MODE, f"cannot convert PIL mode {image.mode!r} to RGB: {exc}"
        ) from None


def probe_image_bytes(raw: bytes, *, max_pixels: int) -> tuple[int, int]:
    """(width, height) after EXIF orientation, read from the header alone.

    Applies the same format and size checks as :func:`decode_image_bytes`
    without decoding pixels, so a request's token count can be known (and a bad
    image refused) long before its pixels are needed. Corrupt pixel data is only
    found by the full decode.
    """
    if not raw:
        raise ImageDecodeError(DecodeFailure.EMPTY, "image data is empty (0 bytes)")
    fmt = _sniff_format(raw)
    with _open_header(raw, fmt) as image:
        check_pixel_limit(image.width, image.height, max_pixels)
        orientation = _exif_orientation(image, fmt, raw)
        if orientation in (5, 6, 7, 8):  # the transposing orientations swap the axes
            return image.height, image.width
        return image.width, image.height


def decode_image_bytes(raw: bytes, *, max_pixels: int) -> Image.Image:
    """Decode image file bytes to an RGB image; see the module doc for the rules."""
    if not raw:
        raise ImageDecodeError(DecodeFailure.EMPTY, "image data is empty (0 bytes)")
    fmt = _sniff_format(raw)
    image = _open_header(raw, fmt)
    check_pixel_limit(image.width, image.height, max_pixels)
    _load_pixels(image, fmt)
    image = _apply_exif_orientation(image, fmt)
    return to_rgb(image)


def decode_image(data: bytes | str, *, max_pixels: int) -> Image.Image:
    """Decode raw image bytes or a ``data:image/<fmt>;base64,`` URI to an RGB image.

    Raises :class:`ImageDecodeError` (a ``ValueError``) with a ``reason`` for every
    kind of bad input; see the module doc for the format, size and RGB rules.
    """
    if max_pixels <= 0:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    return decode_image_bytes(image_bytes_from_input(data), max_pixels=max_pixels)
