"""Baselines the benchmarks compare our engine with."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import torch


def white_background_rgb(image):
    """`image` (PIL) as RGB, transparency composited onto white: the RGB rule of our decoder
    and of transformers' `convert_to_rgb` since 5.2x. Older transformers (5.17 on the GPU
    image) drop the alpha channel instead, so baselines and tests hand transformers images
    already converted by this function, and see the same pixels on every version >= 5.0.
    Uses only PIL's public API."""
    from PIL import Image

    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    return image.convert("RGB")


def transformers_pil_image_processor_class():
    """transformers' PIL-backed Qwen2-VL image processor: `Qwen2VLImageProcessorPil` (exported
    at the top level since 5.1x), or, on older 5.x, `Qwen2VLImageProcessor`, which was the
    PIL/numpy one then."""
    import transformers

    return getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor


def transformers_smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int):
    """transformers' Qwen2-VL `smart_resize`, from the module of the class above."""
    import importlib

    module = importlib.import_module(transformers_pil_image_processor_class().__module__)
    return module.smart_resize(height, width, factor, min_pixels, max_pixels)


def transformers_image_processor(ours):
    """transformers' PIL image processor with the settings of our `ImageProcessor` `ours`."""
    return transformers_pil_image_processor_class()(
        patch_size=ours.patch_size,
        temporal_patch_size=ours.temporal_patch_size,
        merge_size=ours.merge_size,
        image_mean=list(ours.image_mean),
        image_std=list(ours.image_std),
        size={"shortest_edge": ours.min_pixels, "longest_edge": ours.max_pixels},
        resample=int(ours.resample),
        rescale_factor=ours.rescale_factor,
    )


def transformers_processor(ours, tokenizer):
    """transformers' `Qwen3VLProcessor` for images and text only (no video processor), with
    our image settings `ours` and `tokenizer`."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class ImageOnlyProcessor(Qwen3VLProcessor):
        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

    return ImageOnlyProcessor(image_processor=transformers_image_processor(ours), tokenizer=tokenizer)


class TransformersPipeline:
    """transformers' own path: processor (template, tokenizer, PIL image processor) + generate."""

    def __init__(self, model_dir: Path, model=None) -> None:
        """`model_dir` gives tokenizer, template and image settings; `model` (optional) is an
        already built transformers model, else it is loaded from `model_dir`."""
        from transformers import AutoTokenizer, Qwen3VLMoeForConditionalGeneration

        from vlm_catalog.preprocess.chat_template import load_chat_template
        from vlm_catalog.preprocess.image import ImageProcessor

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        self.processor = transformers_processor(ImageProcessor.from_pretrained(model_dir), self.tokenizer)
        self.template = load_chat_template(model_dir)
        if model is None:
            model = Qwen3VLMoeForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32)
        self.model = model.eval()
        self.image_token_id = self.model.config.image_token_id

    def _inputs(self, conversations: list[list[dict]]) -> dict:
        from PIL import Image

        texts, images = [], []
        for messages in conversations:
            template_messages = []
            for message in messages:
                content = message["content"]
                if isinstance(content, list):
                    parts = []
                    for part in content:
                        if part["type"] == "image_url":
                            raw = _data_uri_bytes(part["image_url"]["url"])
                            images.append(white_background_rgb(Image.open(io.BytesIO(raw))))
                            parts.append({"type": "image"})
                        else:
                            parts.append(part)
                    content = parts
                template_messages.append({"role": message["role"], "content": content})
            texts.append(self.tokenizer.apply_chat_template(
                template_messages, chat_template=self.template, tokenize=False, add_generation_prompt=True
            ))
        inputs = self.processor(text=texts, images=images, padding=True, padding_side="left", return_tensors="pt")
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).int()
        device = next(self.model.parameters()).device
        dtype = next(self.model.parameters()).dtype
        return {
            name: value.to(device=device, dtype=dtype) if name == "pixel_values" else value.to(device)
            for name, value in inputs.items()
        }

    @torch.inference_mode()
    def generate(
        self, conversations: list[list[dict]], max_new_tokens: int, logits_processor: list | None = None
    ) -> list[list[int]]:
        """Greedy tokens after each prompt, `max_new_tokens` of them (no early stop: cut them
        at the stop token yourself). `logits_processor`: transformers logits processors, e.g.
        xgrammar's for constrained decoding."""
        inputs = self._inputs(conversations)
        self.model.model.rope_deltas = None
        output = self.model.generate(
            **inputs, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=[], pad_token_id=0,
            logits_processor=logits_processor,
        )
        return output[:, inputs["input_ids"].shape[1]:].tolist()


def _data_uri_bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])
