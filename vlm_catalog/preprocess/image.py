"""Qwen-VL image preprocessing: smart resize, normalise, cut into merge-ordered patches.

Numerically this is transformers' ``Qwen2VLImageProcessorPil`` (the PIL backend,
also what Qwen3-VL uses) on the same settings: identical grids, and pixel values
that differ by at most a few float32 ulps (~1e-7; the tests allow 1e-5) because
rescale and normalise are fused into one ``pixel * scale + offset``. The resize
is PIL's own resampler on the uint8 RGB image, called exactly as transformers
calls it; any other resampler would differ by whole uint8 levels.

Why it is faster than transformers: no numpy round trips of the decoded image
(transformers copies it to numpy and back to PIL before resizing); the uint8
planes are reordered into patch order first, moving each p-pixel row of a patch
as one opaque item and writing the temporal copies while still in uint8; then
float32 conversion and normalisation run block by block over contiguous memory
that stays in cache, so the 23.6 MB float output (992 x 992 image) is written
once, instead of float64 and float32 full-image passes and a strided 7-d copy.

One image runs on one thread: PIL's resampler picks the order of its two passes
from the sizes, so resizing strips of an image separately would change pixels.
:meth:`ImageProcessor.process_many` instead runs whole images concurrently in a
thread pool (PIL decode and resize and torch release the GIL), which is exact.

Output layout (``pixel_values``, float32, ``[grid_h * grid_w, C * T * P * P]``):
rows walk the patch grid merge-block by merge-block: row
``((bh * (grid_w // m) + bw) * m + i) * m + j`` is the patch at grid row
``bh * m + i`` and grid column ``bw * m + j`` (m = merge_size). Within a row the
columns are ``((c * T + t) * P + y) * P + x``: channel, temporal copy (the still
image repeated T times), then the P x P pixels row-major.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vlm_catalog.preprocess.image_decode import (
    DEFAULT_MAX_DECODE_PIXELS,
    DecodeFailure,
    ImageDecodeError,
    check_pixel_limit,
    decode_image_bytes,
    image_bytes_from_input,
    probe_image_bytes,
    to_rgb,
)

__all__ = [
    "ImageInput",
    "ImageProbe",
    "ImageProcessor",
    "ProcessedImage",
    "normalise_patch_bytes",
    "normalised_patches",
    "patch_bytes",
    "smart_resize",
]

ImageInput = Image.Image | bytes | bytearray | memoryview | str

PREPROCESSOR_CONFIG_NAME = "preprocessor_config.json"
# Float32 output converted per block in normalised_patches: small enough to stay
# in a core's L2/L3 between the convert, scale and offset passes.
_BLOCK_BYTES = 1536 * 1024
# Largest width:height (or height:width) ratio the Qwen-VL resize accepts.
MAX_ASPECT_RATIO = 200
# Flags of a transformers image-processor config that this pipeline always
# applies; a config that switches one off (or on, for the last two) is refused
# rather than silently ignored.
_REQUIRED_FLAGS = {
    "do_resize": True,
    "do_rescale": True,
    "do_normalize": True,
    "do_convert_rgb": True,
    "do_center_crop": False,
    "do_pad": False,
}


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """Target ``(height, width)``: multiples of ``factor``, area near the original.

    Each side is rounded to the nearest multiple of ``factor`` (ties to even, as
    Python's ``round``). If that area exceeds ``max_pixels`` both sides shrink by
    ``sqrt(area / max_pixels)`` and round *down* (never below ``factor``); if it is
    under ``min_pixels`` they grow by ``sqrt(min_pixels / area)`` and round *up*.
    The float operations are done in transformers' order, so the result matches
    ``transformers.models.qwen2_vl...smart_resize`` at every boundary.

    Raises ``ValueError`` for a non-positive size or factor, and when the aspect
    ratio exceeds 200 (as transformers does; an ``ImageDecodeError``, reason
    ``aspect_ratio``).
    """
    if height <= 0 or width <= 0:
        raise ValueError(f"image size must be positive, got height={height}, width={width}")
    if factor <= 0:
        raise ValueError(f"factor must be positive, got {factor}")
    aspect_ratio = max(height, width) / min(height, width)
    if aspect_ratio > MAX_ASPECT_RATIO:  # a ValueError, tagged as the image's fault
        raise ImageDecodeError(
            DecodeFailure.ASPECT_RATIO,
            f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, got {aspect_ratio} ({height}x{width})",
        )
    target_h = round(height / factor) * factor
    target_w = round(width / factor) * factor
    if target_h * target_w > max_pixels:
        shrink = math.sqrt((height * width) / max_pixels)
        target_h = max(factor, math.floor(height / shrink / factor) * factor)
        target_w = max(factor, math.floor(width / shrink / factor) * factor)
    elif target_h * target_w < min_pixels:
        grow = math.sqrt(min_pixels / (height * width))
        target_h = math.ceil(height * grow / factor) * factor
        target_w = math.ceil(width * grow / factor) * factor
    return target_h, target_w


@dataclass(frozen=True, eq=False)
class ProcessedImage:
    """One image ready for the vision encoder (compare fields, not instances)."""

    # float32 [grid_t * grid_h * grid_w, C * temporal_patch_size * patch_size**2],
    # rows in merge-block order (see the module doc); uint8 and not yet normalised
    # from `ImageProcessor.process_bytes`
    pixel_values: torch.Tensor
    # (1, resized_height / patch_size, resized_width / patch_size)
    grid_thw: tuple[int, int, int]
    # tokens the image occupies in the language model: grid_h * grid_w / merge_size**2
    num_tokens: int
    # blake2b-128 hex. Bytes / data-URI input: hash of the image *file* bytes (the
    # URI's decoded payload), so both forms of one file agree. PIL input: hash of
    # the RGB pixels and size. The two are domain-separated (distinct blake2b
    # "person" tags). Key for the encoder cache and the prefix cache; it depends on
    # the image only, so a cache shared by differently configured processors must
    # add the processor's settings to the key.
    content_hash: str


@dataclass(frozen=True)
class ImageProbe:
    """What is known of an image before its pixels are decoded (see `ImageProcessor.probe`)."""

    source: bytes | Image.Image  # what `ImageProcessor.process` takes
    grid_thw: tuple[int, int, int]
    num_tokens: int
    content_hash: str


def _file_hash(raw: bytes) -> str:
    return hashlib.blake2b(raw, digest_size=16, person=b"vlm-img-file").hexdigest()


def _pixel_hash(rgb: Image.Image) -> str:
    digest = hashlib.blake2b(digest_size=16, person=b"vlm-img-rgb")
    digest.update(f"{rgb.width}x{rgb.height}:".encode())
    digest.update(rgb.tobytes())
    return digest.hexdigest()


def _opaque_dtype(num_bytes: int) -> np.dtype:
    """A numpy dtype of exactly ``num_bytes`` bytes, only ever copied, never computed on.

    Sizes with a built-in numpy type use it (numpy copies those with fixed-size
    loops, ~2x faster than a void type); e.g. complex128 is a 16-byte container
    here, its bits are moved untouched.
    """
    builtin = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.complex128}
    return np.dtype(builtin.get(num_bytes, (np.void, num_bytes)))


def patch_bytes(rgb: Image.Image, *, patch_size: int, merge_size: int, temporal_patch_size: int) -> torch.Tensor:
    """The image's uint8 pixels laid out as Qwen-VL patches, not yet normalised.

    ``rgb`` is an RGB image whose sides are multiples of ``patch_size * merge_size``.
    Returns uint8 ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` in the
    layout of :func:`normalised_patches` (module doc), a quarter of its bytes: the
    engine copies these to the GPU and normalises them there
    (:func:`normalise_patch_bytes`).
    """
    if rgb.mode != "RGB":
        raise ValueError(f"expected an RGB image, got mode {rgb.mode!r}")
    width, height = rgb.size
    factor = patch_size * merge_size
    if height % factor or width % factor:
        raise ValueError(
            f"image size {width}x{height} is not a multiple of patch_size * merge_size = {factor}"
        )
    p, m, t = patch_size, merge_size, temporal_patch_size
    grid_h, grid_w = height // p, width // p
    num_patches, channels = grid_h * grid_w, 3

    # One patch row (p consecutive uint8 pixels of one channel) as one opaque
    # p-byte element, so the reorder moves p-byte items rather than single bytes.
    patch_row = _opaque_dtype(p)
    # [gh/m, gw/m, m(i), m(j), C, T, p(y)] patch rows
    frame = np.empty((grid_h // m, grid_w // m, m, m, channels, t, p), dtype=patch_row)
    for channel, band in enumerate("RGB"):
        plane = np.frombuffer(rgb.tobytes("raw", band), dtype=np.uint8)  # [H*W]
        # [gh/m, m(i), p(y), gw/m, m(j)] patch rows
        rows = plane.view(patch_row).reshape(grid_h // m, m, p, grid_w // m, m)
        # [gh/m, gw/m, m(i), m(j), 1(t), p(y)]
        in_patch_order = rows.transpose(0, 3, 1, 4, 2)[:, :, :, :, None, :]
        frame[:, :, :, :, channel, :, :] = in_patch_order  # the still frame, T times
    # [N, C*T*p*p] uint8, rows in merge-block order
    return torch.from_numpy(frame.view(np.uint8).reshape(num_patches, channels * t * p * p))


def normalise_patch_bytes(pixel_bytes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """``scale * pixel + offset`` per channel of :func:`patch_bytes`' rows, in float32.

    ``pixel_bytes`` uint8 ``[N, C * T * P * P]``; ``scale`` and ``offset`` float32 ``[C, 1]``
    on its device. Returns float32 ``[N, C * T * P * P]``: the same numbers on every device
    (a conversion, then one float32 multiply and one add, each rounded: no fused multiply-add).
    On CPU a cache-sized block of rows at a time, so the float output is written to memory
    once (23.6 MB for a 992 x 992 image); elsewhere in one pass.
    """
    num_patches, patch_dim = pixel_bytes.shape
    channels = scale.shape[0]
    by_channel = pixel_bytes.view(num_patches, channels, patch_dim // channels)  # [N, C, T*P*P]
    pixel_values = torch.empty(by_channel.shape, dtype=torch.float32, device=pixel_bytes.device)
    rows_per_block = max(1, _BLOCK_BYTES // (patch_dim * 4) if pixel_bytes.device.type == "cpu" else num_patches)
    for start in range(0, num_patches, rows_per_block):
        block = pixel_values[start:start + rows_per_block]  # [rows, C, T*P*P]
        block.copy_(by_channel[start:start + rows_per_block])  # uint8 -> float32
        block.mul_(scale).add_(offset)  # scale, offset: [C, 1]
    return pixel_values.view(num_patches, patch_dim)  # [N, C*T*P*P]


def normalised_patches(
    rgb: Image.Image,
    *,
    patch_size: int,
    merge_size: int,
    temporal_patch_size: int,
    scale: torch.Tensor,
    offset: torch.Tensor,
) -> torch.Tensor:
    """``scale * pixel + offset`` per channel, laid out as Qwen-VL patches.

    ``rgb`` is an RGB image whose sides are multiples of ``patch_size * merge_size``;
    ``scale`` and ``offset`` are float32 ``[3, 1]``. Returns float32
    ``[grid_h * grid_w, 3 * temporal_patch_size * patch_size**2]`` (module doc).
    """
    pixel_bytes = patch_bytes(rgb, patch_size=patch_size, merge_size=merge_size,
                              temporal_patch_size=temporal_patch_size)
    return normalise_patch_bytes(pixel_bytes, scale, offset)


def _as_rgb_triple(name: str, value: float | Sequence[float]) -> tuple[float, float, float]:
    if isinstance(value, (int, float)):
        return (float(value),) * 3
    values = tuple(float(v) for v in value)
    if len(values) != 3:
        raise ValueError(f"{name} must have 3 values (one per RGB channel), got {list(values)}")
    return values  # type: ignore[return-value]


def _available_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


# What transformers' Qwen2VLImageProcessor (Qwen3-VL's too) takes for a key its config omits: Qwen2-VL's
# values, where ours are Qwen3-VL's. A config must give these, so that both read it alike.
_TRANSFORMERS_DEFAULTS = {
    "patch_size": 14,
    "image_mean": (0.48145466, 0.4578275, 0.40821073),  # transformers.image_utils.OPENAI_CLIP_MEAN
    "image_std": (0.26862954, 0.26130258, 0.27577711),  # OPENAI_CLIP_STD
    "min_pixels": 56 * 56,
    "max_pixels": 28 * 28 * 1280,
}


def _check_no_qwen2_vl_defaults(settings: Mapping[str, Any]) -> None:
    missing = [key for key in _TRANSFORMERS_DEFAULTS if key not in settings]
    if missing:
        theirs = ", ".join(f"{key} {_TRANSFORMERS_DEFAULTS[key]}" for key in missing)
        raise ValueError(
            f"config gives no {', '.join(missing)}: transformers would take Qwen2-VL's defaults ({theirs}) and "
            "this pipeline Qwen3-VL's, so the two would make other images; give them (min_pixels and max_pixels "
            "as 'size': {'shortest_edge', 'longest_edge'})"
        )


@dataclass(frozen=True)
class ImageProcessor:
    """Qwen-VL image preprocessing configured like a checkpoint's preprocessor_config.json.

    Defaults are Qwen3-VL's. ``min_pixels`` / ``max_pixels`` bound the *resized*
    area (the config's ``size.shortest_edge`` / ``size.longest_edge``);
    ``max_decode_pixels`` bounds the *input* image and is a safety limit of ours,
    not part of transformers' config (images over it are refused).
    """

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    resample: Image.Resampling = Image.Resampling.BICUBIC
    rescale_factor: float = 1 / 255
    max_decode_pixels: int = DEFAULT_MAX_DECODE_PIXELS
    # float32 [3, 1] per-channel scale and offset: pixel * scale + offset equals
    # (pixel * rescale_factor - mean) / std; derived, not configuration.
    _scale: torch.Tensor = field(init=False, repr=False, compare=False)
    _offset: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("patch_size", "temporal_patch_size", "merge_size", "min_pixels",
                     "max_pixels", "max_decode_pixels"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.min_pixels > self.max_pixels:
            raise ValueError(
                f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})"
            )
        mean = _as_rgb_triple("image_mean", self.image_mean)
        std = _as_rgb_triple("image_std", self.image_std)
        if any(s == 0 for s in std):
            raise ValueError(f"image_std must not contain 0, got {list(std)}")
        if not self.rescale_factor > 0:
            raise ValueError(f"rescale_factor must be positive, got {self.rescale_factor}")
        try:
            resample = Image.Resampling(self.resample)
        except ValueError:
            raise ValueError(f"unknown PIL resample filter {self.resample!r}") from None
        object.__setattr__(self, "image_mean", mean)
        object.__setattr__(self, "image_std", std)
        object.__setattr__(self, "resample", resample)
        # Computed in float64, rounded once to float32.
        scale = [self.rescale_factor / s for s in std]
        offset = [-mu / s for mu, s in zip(mean, std, strict=True)]
        object.__setattr__(self, "_scale", torch.tensor(scale, dtype=torch.float32).view(3, 1))
        object.__setattr__(self, "_offset", torch.tensor(offset, dtype=torch.float32).view(3, 1))

    # ----------------------------------------------------------------- config
    @classmethod
    def from_config(cls, config: Mapping[str, Any], **overrides: Any) -> ImageProcessor:
        """Build from a ``preprocessor_config.json`` dict (transformers' keys).

        Reads ``size`` as ``{"shortest_edge", "longest_edge"}`` (or the older
        ``{"min_pixels", "max_pixels"}``); top-level ``min_pixels`` / ``max_pixels``
        override it, as in transformers. Also reads patch_size,
        temporal_patch_size, merge_size, image_mean, image_std, resample,
        rescale_factor and our max_decode_pixels; other keys (processor class
        names, video settings) are ignored. Refuses configs that turn off a step
        this pipeline always applies (do_rescale=false, ...). ``overrides`` win.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"config must be a mapping, got {type(config).__name__}")
        for flag, required in _REQUIRED_FLAGS.items():
            if flag in config and config[flag] is not None and bool(config[flag]) != required:
                raise ValueError(
                    f"unsupported image processor config: {flag}={config[flag]!r} "
                    f"(this pipeline always runs with {flag}={required})"
                )
        kwargs: dict[str, Any] = {}
        size = config.get("size")
        if size is not None:
            if not isinstance(size, Mapping):
                raise ValueError(f"config 'size' must be a dict, got {size!r}")
            for ours, keys in (("min_pixels", ("shortest_edge", "min_pixels")),
                               ("max_pixels", ("longest_edge", "max_pixels"))):
                found = [size[k] for k in keys if size.get(k) is not None]
                if found:
                    kwargs[ours] = found[0]
        for key in ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size",
                    "merge_size", "image_mean", "image_std", "resample", "rescale_factor",
                    "max_decode_pixels"):
            if config.get(key) is not None:
                kwargs[key] = config[key]
        kwargs.update(overrides)
        if size is not None and not {"min_pixels", "max_pixels"} <= kwargs.keys():
            raise ValueError(
                "config 'size' must give both 'shortest_edge' and 'longest_edge' "
                f"(the min and max resized area in pixels), or top-level min_pixels/max_pixels the rest, got {dict(size)}"
            )
        _check_no_qwen2_vl_defaults(kwargs)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike[str], **overrides: Any) -> ImageProcessor:
        """Build from ``<directory>/preprocessor_config.json``."""
        path = Path(directory) / PREPROCESSOR_CONFIG_NAME
        if not path.is_file():
            raise FileNotFoundError(
                f"no {PREPROCESSOR_CONFIG_NAME} in {Path(directory)!s} "
                "(expected a checkpoint directory with the image processor config)"
            )
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        return cls.from_config(config, **overrides)

    # ------------------------------------------------------------------ sizes
    @property
    def resize_factor(self) -> int:
        """Resized sides are multiples of this (one merged token = factor x factor px)."""
        return self.patch_size * self.merge_size

    def resized_size(self, height: int, width: int) -> tuple[int, int]:
        """(height, width) an image of this size is resized to."""
        return smart_resize(height, width, self.resize_factor, self.min_pixels, self.max_pixels)

    def grid_thw_for_size(self, height: int, width: int) -> tuple[int, int, int]:
        """Patch grid of an image of this size, without touching pixels."""
        resized_h, resized_w = self.resized_size(height, width)
        return 1, resized_h // self.patch_size, resized_w // self.patch_size

    def num_tokens_for_size(self, height: int, width: int) -> int:
        """Language-model tokens of an image of this size, without touching pixels."""
        _, grid_h, grid_w = self.grid_thw_for_size(height, width)
        return grid_h * grid_w // self.merge_size**2

    def probe(self, image: ImageInput) -> ImageProbe:
        """Grid, token count and content hash of an image, from its header only.

        Bytes and data URIs are checked like a decode (format, pixel limit) but
        not decoded; the returned `source` (the file bytes, or the PIL image) is
        what `process` takes later. The hash equals `process(...).content_hash`.
        """
        if isinstance(image, Image.Image):
            check_pixel_limit(image.width, image.height, self.max_decode_pixels)
            rgb = to_rgb(image)
            width, height, source, content_hash = rgb.width, rgb.height, rgb, _pixel_hash(rgb)
        else:
            source = image_bytes_from_input(image)
            width, height = probe_image_bytes(source, max_pixels=self.max_decode_pixels)
            content_hash = _file_hash(source)
        grid = self.grid_thw_for_size(height, width)
        return ImageProbe(source, grid, grid[1] * grid[2] // self.merge_size**2, content_hash)

    # ----------------------------------------------------------------- stages
    def load(self, image: ImageInput) -> tuple[Image.Image, str]:
        """Stage 1: the RGB image to process and its content hash.

        Bytes and data URIs are decoded by :func:`decode_image_bytes` (format,
        size, EXIF and RGB rules there). A ``PIL.Image`` is taken as it is (no
        EXIF rotation: it is already decoded), checked against
        ``max_decode_pixels`` and converted to RGB by the same rule.
        """
        if isinstance(image, Image.Image):
            check_pixel_limit(image.width, image.height, self.max_decode_pixels)
            rgb = to_rgb(image)
            return rgb, _pixel_hash(rgb)
        raw = image_bytes_from_input(image)
        rgb = decode_image_bytes(raw, max_pixels=self.max_decode_pixels)
        return rgb, _file_hash(raw)

    def resize(self, rgb: Image.Image) -> Image.Image:
        """Stage 2: PIL's resampler on the uint8 image to the smart-resize size."""
        target_h, target_w = self.resized_size(rgb.height, rgb.width)
        if (target_w, target_h) == rgb.size:
            return rgb  # PIL would return an identical copy
        return rgb.resize((target_w, target_h), resample=self.resample)

    def patchify(self, resized: Image.Image) -> torch.Tensor:
        """Stage 3: normalise and lay out as patches (see :func:`normalised_patches`)."""
        return normalised_patches(
            resized,
            patch_size=self.patch_size,
            merge_size=self.merge_size,
            temporal_patch_size=self.temporal_patch_size,
            scale=self._scale,
            offset=self._offset,
        )

    def patch_bytes(self, resized: Image.Image) -> torch.Tensor:
        """Stage 3 without the normalisation: uint8 patch rows (see :func:`patch_bytes`)."""
        return patch_bytes(resized, patch_size=self.patch_size, merge_size=self.merge_size,
                           temporal_patch_size=self.temporal_patch_size)

    @property
    def normalisation(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, offset), float32 ``[3, 1]`` on the CPU: ``pixel * scale + offset`` per channel."""
        return self._scale, self._offset

    # ---------------------------------------------------------------- process
    def process(self, image: ImageInput) -> ProcessedImage:
        """Preprocess one image: PIL image, image file bytes or a data:image base64 URI.

        Raises ``ImageDecodeError`` for undecodable or oversized input, and for an
        aspect ratio over 200.
        """
        return self._process(image, self.patchify)

    def process_bytes(self, image: ImageInput) -> ProcessedImage:
        """:meth:`process` up to the normalisation: ``pixel_values`` are the uint8 patch rows,
        which ``normalise_patch_bytes(pixel_values, *self.normalisation)`` turns into exactly
        what :meth:`process` gives, on any device (the engine does it on the GPU)."""
        return self._process(image, self.patch_bytes)

    def _process(self, image: ImageInput, patchify) -> ProcessedImage:
        rgb, content_hash = self.load(image)
        resized = self.resize(rgb)
        pixel_values = patchify(resized)
        grid_h, grid_w = resized.height // self.patch_size, resized.width // self.patch_size
        return ProcessedImage(
            pixel_values=pixel_values,
            grid_thw=(1, grid_h, grid_w),
            num_tokens=grid_h * grid_w // self.merge_size**2,
            content_hash=content_hash,
        )

    def process_many(
        self, images: Iterable[ImageInput], num_workers: int | None = None
    ) -> list[ProcessedImage]:
        """:meth:`process` every image, concurrently, results in input order.

        ``num_workers`` threads (default: the CPUs this process may run on, at
        most one per image) each process whole images; the result equals calling
        :meth:`process` one by one. The first failure in input order is raised,
        with a note naming the image's index; images not yet started are skipped.
        """
        images = list(images)
        if num_workers is None:
            num_workers = _available_cpus()
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be a positive int, got {num_workers!r}")
        num_workers = min(num_workers, len(images))
        if num_workers <= 1:
            return [self._process_noting_index(image, i, len(images))
                    for i, image in enumerate(images)]
        with ThreadPoolExecutor(num_workers, thread_name_prefix="image-preprocess") as pool:
            futures = [pool.submit(self.process, image) for image in images]
            return [self._result_noting_index(futures, i) for i in range(len(futures))]

    def _process_noting_index(self, image: ImageInput, index: int, total: int) -> ProcessedImage:
        try:
            return self.process(image)
        except Exception as exc:
            exc.add_note(f"while preprocessing image {index} of {total}")
            raise

    @staticmethod
    def _result_noting_index(futures: list[Future[ProcessedImage]], index: int) -> ProcessedImage:
        try:
            return futures[index].result()
        except Exception as exc:
            for later in futures[index + 1:]:
                later.cancel()
            exc.add_note(f"while preprocessing image {index} of {len(futures)}")
            raise
