"""The whole Qwen3-VL-MoE model for serving: vision tower + text decoder + lm head.

Two entry points the engine calls separately, so images can be encoded once
and reused across prefill chunks:
- `encode_images(pixel_values, grid_thw)` -> one `ImageEmbedding` per image;
- `forward(input_ids, positions, attention, multimodal)` -> final hidden states,
  and `compute_logits(hidden)` for the rows that sample.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlm_catalog.model.attention import AttentionBackend
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.model.text import MultimodalEmbeddings, TextDecoder
from vlm_catalog.model.vision import VisionTower


@dataclass
class ImageEmbedding:
    """Encoder output for one image: `embeddings [n_tokens, H]`, `deepstack[j] [n_tokens, H]`."""

    embeddings: torch.Tensor
    deepstack: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return self.embeddings.shape[0]

    def slice(self, start: int, end: int) -> ImageEmbedding:
        return ImageEmbedding(self.embeddings[start:end], [d[start:end] for d in self.deepstack])

    def owning(self) -> ImageEmbedding:
        """This embedding with tensors that hold only its own rows: `encode_images` splits one
        output of several images, whose views would keep the whole output alive in a cache that
        counts only this image's tokens. Copies where a tensor is such a view, else itself."""
        tensors = [self.embeddings, *self.deepstack]
        if all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in tensors):
            return self
        return ImageEmbedding(self.embeddings.clone(), [d.clone() for d in self.deepstack])


class Qwen3VLMoeModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = VisionTower(config.vision)
        self.language_model = TextDecoder(config.text)
        self.lm_head = nn.Linear(config.text.hidden_size, config.text.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.language_model.embed_tokens.weight

    @torch.inference_mode()
    def encode_images(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[ImageEmbedding]:
        """Encode several images at once (pixel rows concatenated); split the output per image."""
        output = self.visual(pixel_values, grid_thw)
        merge_area = self.config.vision.spatial_merge_size**2
        sizes = (grid_thw.prod(dim=-1) // merge_area).tolist()
        embeddings = output.embeddings.split(sizes)
        deepstack_per_layer = [layer.split(sizes) for layer in output.deepstack]
        return [
            ImageEmbedding(embeddings[i], [layer[i] for layer in deepstack_per_layer])
            for i in range(len(sizes))
        ]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        multimodal: MultimodalEmbeddings | None = None,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, attention, multimodal)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] (model dtype) for final hidden states [n, H]."""
        return F.linear(hidden, self.lm_head.weight)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


def multimodal_inputs(
    input_ids: torch.Tensor, image_token_id: int, images: list[ImageEmbedding]
) -> MultimodalEmbeddings | None:
    """Concatenate the given images' features for the placeholder tokens of `input_ids`, in order."""
    mask = input_ids == image_token_id
    if not images:
        if bool(mask.any()):
            raise ValueError("input_ids hold image placeholders but no image features were given")
        return None
    count = int(mask.sum())
    provided = sum(image.num_tokens for image in images)
    if count != provided:
        raise ValueError(f"{count} image placeholder tokens but {provided} image feature rows")
    return MultimodalEmbeddings(
        rows=mask.nonzero().flatten(),
        embeddings=torch.cat([image.embeddings for image in images]),
        deepstack=[
            torch.cat([image.deepstack[j] for image in images])
            for j in range(len(images[0].deepstack))
        ],
    )
