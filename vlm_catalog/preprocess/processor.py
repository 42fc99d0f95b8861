"""Turn OpenAI-style chat messages with images into model inputs.

`PromptProcessor.process(messages)` renders the chat template, tokenises the
text, preprocesses the images, expands each image's single `<|image_pad|>`
placeholder into as many tokens as the image has merged patches, and computes
the MRoPE positions. The result, `ProcessedPrompt`, is what the engine queues.

Image parts may be `{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}`
(OpenAI form; a bare string URL is accepted too) or `{"type": "image", "image": <bytes |
PIL.Image | data URI>}`. Remote URLs are refused: the server never fetches.

Messages are checked before rendering: the role must be one of `ROLES`, and
text must be valid Unicode (a lone surrogate such as "\\ud800", which JSON
escapes can carry, is refused with a `PromptError` naming the message instead
of failing inside the tokenizer).

Text that contains the tokenizer's special-token strings (e.g. "<|im_end|>" in a
scraped description) would otherwise be read as control tokens; such strings
in message text are broken with a zero-width space before rendering.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from vlm_catalog.error_text import one_line
from vlm_catalog.model.config import ModelConfigError, VisionConfig
from vlm_catalog.preprocess.chat_template import load_chat_template, render_chat
from vlm_catalog.preprocess.image import ImageProbe, ImageProcessor
from vlm_catalog.preprocess.mrope import mrope_delta, mrope_positions

ZERO_WIDTH_SPACE = "\u200b"
ROLES = ("system", "user", "assistant")  # the roles the chat templates render


class PromptError(ValueError):
    """Messages that cannot be turned into a prompt; the message says why."""


@dataclass
class ProcessedPrompt:
    """A tokenised prompt whose images are known by their headers, not yet by their pixels.

    Holding no pixels and no positions until they are needed keeps a queued
    request small (the offline benchmark queues 48k of them): pixels are made
    by `PromptProcessor.load_pixels` when the vision encoder runs, positions on
    first use and dropped with `release_positions`. The token ids are held as
    an `array("i")` (4 bytes each; a list given is converted): as a list of
    Python ints a 1,100-token prompt took 33 KiB, as an array 4.5 KiB.
    """

    token_ids: array  # array("i"), a sequence of ints
    images: list[ImageProbe]
    image_spans: list[tuple[int, int]]  # (first token index, token count) per image, in order
    merge_size: int = 2
    mrope_delta: int = field(init=False)  # generated token at index n sits at position n + mrope_delta

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, array) or self.token_ids.typecode != "i":
            self.token_ids = array("i", self.token_ids)
        self.mrope_delta = mrope_delta(len(self.token_ids), self.image_spans, self._grids, self.merge_size)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def _grids(self) -> list[tuple[int, int, int]]:
        return [image.grid_thw for image in self.images]

    @cached_property
    def positions(self) -> torch.Tensor:
        """MRoPE positions [3, num_tokens] (int64)."""
        positions, _ = mrope_positions(len(self.token_ids), self.image_spans, self._grids, self.merge_size)
        return positions

    def release_positions(self) -> None:
        self.__dict__.pop("positions", None)


class PromptProcessor:
    def __init__(
        self,
        tokenizer: Any,
        image_processor: ImageProcessor,
        chat_template: str,
        image_token_id: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.image_processor = image_processor
        self.chat_template = chat_template
        self.image_token_id = image_token_id
        self.image_token = tokenizer.convert_ids_to_tokens(image_token_id)
        self._special_strings = sorted(
            {token for token in tokenizer.all_special_tokens} | set(getattr(tokenizer, "added_tokens_encoder", {})),
            key=len,
            reverse=True,
        )

    @classmethod
    def from_pretrained(
        cls, checkpoint_dir: str | Path, image_token_id: int, vision: VisionConfig | None = None, **image_overrides: Any,
    ) -> PromptProcessor:
        """The checkpoint's tokenizer, image processor and chat template; `vision`, the model's vision
        config, is checked against the image processor (`check_image_cutting`)."""
        from transformers import AutoTokenizer

        checkpoint_dir = Path(checkpoint_dir)
        try:
            tokenizer = AutoTokenizer.from_pretrained(str(checkpoint_dir))
        except Exception as exc:  # noqa: BLE001 - tokenizers, transformers and json raise many kinds for a damaged file
            raise ModelConfigError(f"{checkpoint_dir}: the tokenizer cannot be loaded ({one_line(exc)})") from None
        try:
            image_processor = (
                ImageProcessor.from_pretrained(checkpoint_dir, **image_overrides)
                if (checkpoint_dir / "preprocessor_config.json").is_file()
                else ImageProcessor(**image_overrides)
            )
            chat_template = load_chat_template(checkpoint_dir)
        except (OSError, ValueError) as exc:
            message = one_line(exc)
            raise ModelConfigError(message if str(checkpoint_dir) in message else f"{checkpoint_dir}: {message}") from None
        if vision is not None:
            check_image_cutting(image_processor, vision, checkpoint_dir)
        processor = cls(tokenizer, image_processor, chat_template, image_token_id)
        try:
            processor.check_template()
        except PromptError as exc:
            raise ModelConfigError(f"{checkpoint_dir}: the chat template cannot make a prompt: {exc}") from None
        return processor

    def check_template(self) -> None:
        """Render a user turn with one image and a text; `PromptError` unless the template renders
        it with exactly one image placeholder. Run at load, so a broken template stops the start,
        not every request after it."""
        probe = [{"role": "user", "content": [{"type": "image", "image": b""}, {"type": "text", "text": "a"}]}]
        text, _ = self.render(probe)
        placeholders = self.tokenizer(text, add_special_tokens=False)["input_ids"].count(self.image_token_id)
        if placeholders != 1:
            raise PromptError(
                f"it renders {placeholders} image placeholders ({self.image_token!r}) for one image"
            )

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> tuple[str, list[Any]]:
        """The prompt text (one placeholder per image) and the image inputs in order."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list of {role, content} objects")
        images: list[Any] = []
        cleaned = [self._clean_message(message, position, images) for position, message in enumerate(messages)]
        try:
            text = render_chat(self.tokenizer, self.chat_template, cleaned, add_generation_prompt)
        except Exception as exc:  # the template's own raise_exception and Jinja errors
            raise PromptError(f"the chat template rejected the messages: {exc}") from None
        return text, images

    def process(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> ProcessedPrompt:
        text, image_inputs = self.render(messages, add_generation_prompt)
        token_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        placeholder_indices = [i for i, token in enumerate(token_ids) if token == self.image_token_id]
        if len(placeholder_indices) != len(image_inputs):
            raise PromptError(
                f"the rendered prompt has {len(placeholder_indices)} image placeholders for "
                f"{len(image_inputs)} images (does the chat template emit {self.image_token!r} per image?)"
            )
        images = [self.image_processor.probe(image) for image in image_inputs]
        return self.expand(token_ids, images)

    def load_pixels(self, images: list[ImageProbe]) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode and patchify images (in a thread pool): pixel rows [N, D] and grids [n, 3]."""
        processed = self.image_processor.process_many([image.source for image in images])
        for probe, image in zip(images, processed):
            if tuple(image.grid_thw) != tuple(probe.grid_thw):
                raise PromptError(f"image decoded to grid {image.grid_thw}, its header said {probe.grid_thw}")
        pixel_values = torch.cat([image.pixel_values for image in processed])
        return pixel_values, torch.tensor([image.grid_thw for image in processed])

    def expand(self, token_ids: list[int], images: list[ImageProbe]) -> ProcessedPrompt:
        """Replace the i-th image placeholder token by images[i].num_tokens copies."""
        expanded = array("i")
        spans: list[tuple[int, int]] = []
        image_iter = iter(images)
        for token in token_ids:
            if token != self.image_token_id:
                expanded.append(token)
                continue
            image = next(image_iter)
            spans.append((len(expanded), image.num_tokens))
            expanded.extend([self.image_token_id] * image.num_tokens)
        return ProcessedPrompt(expanded, images, spans, self.image_processor.merge_size)

    def _clean_message(self, message: Any, position: int, images: list[Any]) -> dict[str, Any]:
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise PromptError(f"message {position} must be an object with 'role' and 'content'")
        role = message["role"]
        if role not in ROLES:
            raise PromptError(f"message {position}: unknown role {role!r}; use one of {', '.join(ROLES)}")
        content = message["content"]
        if isinstance(content, str):
            return {"role": role, "content": self._neutralise(_checked_text(content, f"message {position}"))}
        if not isinstance(content, list):
            raise PromptError(f"message {position}: content must be a string or a list of parts")
        parts = []
        for index, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text = _checked_text(str(part.get("text", "")), f"message {position}, part {index}")
                parts.append({"type": "text", "text": self._neutralise(text)})
            elif kind in ("image_url", "image"):
                images.append(self._image_input(part, kind, position, index))
                parts.append({"type": "image"})
            else:
                raise PromptError(f"message {position}, part {index}: unsupported content part type {kind!r}")
        return {"role": role, "content": parts}

    @staticmethod
    def _image_input(part: dict[str, Any], kind: str, position: int, index: int) -> Any:
        where = f"message {position}, part {index}"
        if kind == "image":
            if part.get("image") is None:
                raise PromptError(f"{where}: image part has no 'image'")
            return part["image"]
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise PromptError(f"{where}: image_url needs a 'url'")
        if url.startswith(("http://", "https://")):
            raise PromptError(f"{where}: remote image URLs are not fetched; send a data:image/...;base64 URI")
        return url

    def _neutralise(self, text: str) -> str:
        for token in self._special_strings:
            if token in text:
                text = text.replace(token, token[:2] + ZERO_WIDTH_SPACE + token[2:])
        return text


def _checked_text(text: str, where: str) -> str:
    """`text` if it is valid Unicode; a lone surrogate (no UTF-8 form) raises `PromptError`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"{where}: text contains an unpaired surrogate {text[exc.start]!r} at character {exc.start} "
            "(not valid Unicode)"
        ) from None
    return text


def check_image_cutting(image_processor: ImageProcessor, vision: VisionConfig, checkpoint_dir: str | Path) -> None:
    """`ModelConfigError` where preprocessor_config.json cuts images otherwise than config.json's
    vision tower reads them. A patch size or channel count the tower does not take failed every
    image request; a merge size it does not use served wrong answers silently (the prompt held the
    preprocessor's count of image tokens, the tower gave another, and the rows were cut to fit).
    transformers refuses both at the first image."""
    pairs = {
        "patch_size": (image_processor.patch_size, vision.patch_size),
        "temporal_patch_size": (image_processor.temporal_patch_size, vision.temporal_patch_size),
        "merge_size": (image_processor.merge_size, vision.spatial_merge_size),
    }
    for name, (cut, read) in pairs.items():
        if cut != read:
            tower_name = "spatial_merge_size" if name == "merge_size" else name
            raise ModelConfigError(
                f"{checkpoint_dir}: preprocessor_config.json has {name} {cut}, but config.json's vision_config "
                f"has {tower_name} {read}; the two must agree"
            )
