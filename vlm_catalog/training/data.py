"""Training examples from the synthetic generator, shown exactly as the engine shows them.

Example k of a `TrainingMix` is record k of generator seed `mix.seed`, with
its own random stream ("training-mix", seed, k) deciding whether its brand is
replaced by a freshly made-up one (so the model must copy brands from the
text instead of memorising a list), whether its photo is realistic-sized and
whether a second-hand item loses its text cues (so the model must read the
photo's condition sticker).
The prompt is the benchmark's mlperf prompt, processed by our
`PromptProcessor`; the answer is compact ProductMetadata JSON then <|im_end|>.
Batch s holds examples s*B .. s*B+B-1, so the data of a step depends only on
the step: a resumed run sees the same batches as an uninterrupted one.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from schemas import ProductRecord
from vlm_catalog.data.synthetic.records import RecordFactory, SyntheticRecord, default_factory
from vlm_catalog.data.synthetic.seeding import record_rng
from vlm_catalog.data.synthetic.vocabulary import fresh_brand
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.preprocess.processor import PromptProcessor
from vlm_catalog.preprocess.prompt import build_mlperf_messages

IGNORE = -100


@dataclass(frozen=True)
class TrainingMix:
    """Which synthetic records a run trains on, and how they are varied."""

    seed: int = 3000  # generator seed of the training records (never a held-out seed)
    fresh_brand_rate: float = 0.4  # share of records whose brand is made up for the example
    fresh_brand_words: bool = True  # made-up brands from whole tokenizer words, else syllables
    realistic_image_rate: float = 0.05  # share of records with benchmark-sized photos
    # share of second-hand records whose text cues are dropped, so only the photo's sticker
    # tells (catalogues have a quarter of such items; 0: as the generator makes them)
    photo_only_condition_rate: float = 0.0
    brand_weight: float = 5.0  # loss weight of the answer's brand tokens
    flag_weight: float = 3.0  # loss weight of the answer's is_secondhand value tokens
    # loss weight of the category tokens that tell the answer from its nearest candidate:
    # from where it first differs from every other candidate (usually the last level) to its end
    category_weight: float = 1.0
    # weight of next-token prediction on the listing's own text (title, description, candidates),
    # next to the answer loss: text that repeats itself (the brand, the category names) teaches copying
    prompt_lm_weight: float = 0.5

    def __post_init__(self) -> None:
        """Refuse, before any work, a mix that would train on nonsense: the rates are shares of the
        records (from 0 to 1: a rate of 5 is "always", -2 "never"); the weights scale token losses
        next to the other answer tokens' 1 (finite, at least 0: a negative one rewards the wrong
        token and drove the loss below 0; NaN stopped the run only after its first step)."""
        for name in ("fresh_brand_rate", "realistic_image_rate", "photo_only_condition_rate"):
            value = getattr(self, name)
            if not 0 <= value <= 1:  # NaN fails too
                raise ValueError(f"{name} must be a share from 0 to 1, got {value}")
        for name in ("brand_weight", "flag_weight", "category_weight", "prompt_lm_weight"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:
                raise ValueError(f"{name} must be a finite number of at least 0, got {value}")

    def record(self, factory: RecordFactory, index: int, words: tuple[str, ...] = ()) -> SyntheticRecord:
        """Example `index`; `words` are the stems of made-up brands (see `brand_words`)."""
        chooser = record_rng("training-mix", self.seed, index)
        stems = words if self.fresh_brand_words else ()
        brand = fresh_brand(chooser, stems) if chooser.random() < self.fresh_brand_rate else None
        image_size = "realistic" if chooser.random() < self.realistic_image_rate else "small"
        photo_only = chooser.random() < self.photo_only_condition_rate
        return factory.make(self.seed, index, image_size, brand=brand, photo_only_condition=photo_only)


def answer_text(category: str, brand: str, is_secondhand: bool) -> str:
    """The target answer: compact ProductMetadata JSON, keys in schema order."""
    return json.dumps(
        {"category": category, "brand": brand, "is_secondhand": is_secondhand},
        separators=(",", ":"),
    )


@dataclass
class Example:
    prompt_ids: list[int]
    images: list  # the prompt's images, for `PromptProcessor.load_pixels`
    answer_ids: list[int]  # answer tokens, <|im_end|> last
    answer_weights: list[float]  # loss weight of each answer token


@dataclass
class Batch:
    """Model inputs plus the answer positions the loss reads."""

    inputs: dict[str, torch.Tensor]  # input_ids, attention_mask, pixel_values, image_grid_thw, mm_token_type_ids
    rows: torch.Tensor  # (T,) batch row of each answer token
    positions: torch.Tensor  # (T,) position whose hidden state predicts that token
    targets: torch.Tensor  # (T,) the answer token ids
    weights: torch.Tensor  # (T,) their loss weights
    prefix_length: int = 0  # leading tokens every row shares (the system prompt); 0: none
    # next-token targets inside the listing's text (after the shared prefix, no image tokens)
    text_rows: torch.Tensor | None = None  # (U,)
    text_positions: torch.Tensor | None = None  # (U,)
    text_targets: torch.Tensor | None = None  # (U,)

    def to(self, device: torch.device | str) -> Batch:
        def move(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor.to(device)

        return Batch(
            {name: tensor.to(device) for name, tensor in self.inputs.items()},
            self.rows.to(device), self.positions.to(device), self.targets.to(device),
            self.weights.to(device), self.prefix_length,
            move(self.text_rows), move(self.text_positions), move(self.text_targets),
        )


def deciding_offset(category: str, candidates) -> int:
    """Where `category` first differs from every other candidate: the length of its longest
    common prefix with any of them (0 when there is no other candidate)."""
    others = [candidate for candidate in candidates if candidate != category]
    return max((len(os.path.commonprefix([category, other])) for other in others), default=0)


def brand_words(tokenizer) -> tuple[str, ...]:
    """Words that are one token of `tokenizer`: letters only, 3+ long (stems of made-up brands)."""
    words = set()
    for token in tokenizer.get_vocab():
        text = tokenizer.convert_tokens_to_string([token]).strip()
        if len(text) >= 3 and text.isascii() and text.isalpha():
            words.add(text)
    return tuple(sorted(words))


class ExampleBuilder:
    """Turns synthetic records into tokenised examples and padded batches for one checkpoint."""

    def __init__(self, checkpoint: Path, mix: TrainingMix, factory: RecordFactory | None = None) -> None:
        config = ModelConfig.from_pretrained(checkpoint)
        self.image_token_id = config.image_token_id
        self.processor = PromptProcessor.from_pretrained(checkpoint, image_token_id=config.image_token_id, vision=config.vision)
        self.tokenizer = self.processor.tokenizer
        self.end_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.mix = mix
        self.factory = factory or default_factory()
        self.shared_prefix = self._shared_prefix()
        self.brand_words = brand_words(self.tokenizer)

    def _shared_prefix(self) -> list[int]:
        """The tokens every mlperf prompt starts with: the system prompt up to the title."""
        image = default_factory().make(0, 0).image_jpeg
        first, second = (
            self.processor.process(build_mlperf_messages(ProductRecord(
                title=title, description="d", image=image, candidate_categories=["a", "b"],
            ))).token_ids
            for title in ("Alpha", "(Beta 2")
        )
        length = 0
        while first[length] == second[length]:
            length += 1
        return list(first[:length])

    def example(self, index: int) -> Example:
        record = self.mix.record(self.factory, index, self.brand_words)
        prompt = self.processor.process(build_mlperf_messages(ProductRecord(
            title=record.title, description=record.description,
            image=record.image_jpeg, candidate_categories=list(record.candidates),
        )))
        answer_ids, weights = self._answer(record)
        return Example(list(prompt.token_ids), list(prompt.images), answer_ids, weights)

    def _answer(self, record: SyntheticRecord) -> tuple[list[int], list[float]]:
        text = answer_text(record.category, record.brand, record.is_secondhand)
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        category_start = text.index('"category":"') + len('"category":"')
        escaped = json.dumps(record.category)[1:-1]  # as the answer text spells it
        deciding = deciding_offset(escaped, [json.dumps(c)[1:-1] for c in record.candidates])
        category_span = (category_start + deciding, category_start + len(escaped))
        brand_start = text.index('"brand":"') + len('"brand":"')
        brand_span = (brand_start, brand_start + len(json.dumps(record.brand)) - 2)
        flag_start = text.index('"is_secondhand":') + len('"is_secondhand":')
        weights = []
        for start, end in encoded["offset_mapping"]:
            if start < category_span[1] and end > category_span[0]:
                weights.append(self.mix.category_weight)
            elif start < brand_span[1] and end > brand_span[0]:
                weights.append(self.mix.brand_weight)
            elif end > flag_start:
                weights.append(self.mix.flag_weight)
            else:
                weights.append(1.0)
        return list(encoded["input_ids"]) + [self.end_id], weights + [1.0]

    def batch(self, indices: list[int]) -> Batch:
        examples = [self.example(index) for index in indices]
        length = max(len(e.prompt_ids) + len(e.answer_ids) for e in examples)
        input_ids = torch.zeros(len(examples), length, dtype=torch.long)  # (B, L), right-padded
        attention_mask = torch.zeros_like(input_ids)
        rows, positions, targets, weights = [], [], [], []
        for row, example in enumerate(examples):
            sequence = example.prompt_ids + example.answer_ids
            input_ids[row, : len(sequence)] = torch.tensor(sequence)
            attention_mask[row, : len(sequence)] = 1
            first = len(example.prompt_ids)
            for offset, (token, weight) in enumerate(zip(example.answer_ids, example.answer_weights)):
                rows.append(row)
                positions.append(first + offset - 1)  # the hidden state before a token predicts it
                targets.append(token)
                weights.append(weight)
        pixel_values, grids = self.processor.load_pixels([image for e in examples for image in e.images])
        inputs = {
            "input_ids": input_ids, "attention_mask": attention_mask,
            "pixel_values": pixel_values, "image_grid_thw": grids,
            "mm_token_type_ids": (input_ids == self.image_token_id).int(),
        }
        prefix = self.shared_prefix
        shares_prefix = all(e.prompt_ids[: len(prefix)] == prefix for e in examples)
        first_text = len(prefix) + 1 if shares_prefix else 1  # first target inside the listing
        text_rows, text_positions, text_targets = [], [], []
        for row, example in enumerate(examples):
            for index in range(first_text, len(example.prompt_ids)):
                if example.prompt_ids[index] != self.image_token_id:
                    text_rows.append(row)
                    text_positions.append(index - 1)
                    text_targets.append(example.prompt_ids[index])
        return Batch(
            inputs, torch.tensor(rows), torch.tensor(positions), torch.tensor(targets),
            torch.tensor(weights, dtype=torch.float32), len(prefix) if shares_prefix else 0,
            torch.tensor(text_rows), torch.tensor(text_positions), torch.tensor(text_targets),
        )
