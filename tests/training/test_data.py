"""Training examples: the answer the loss reads, brand weighting, the mixture, fresh brands."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from vlm_catalog.data.synthetic.condition_cues import mentions_secondhand
from vlm_catalog.data.synthetic.records import default_factory
from vlm_catalog.data.synthetic.vocabulary import brand_names, fresh_brand
from vlm_catalog.training.data import ExampleBuilder, TrainingMix, answer_text, deciding_offset


def test_fresh_brands_are_new_varied_and_reproducible() -> None:
    names = [fresh_brand(random.Random(seed)) for seed in range(300)]
    assert names == [fresh_brand(random.Random(seed)) for seed in range(300)]
    assert len(set(names)) > 290
    known = set(brand_names())
    assert sum(name in known for name in names) <= 3
    assert any(name.isupper() or name.split()[0].isupper() for name in names)
    assert all(name.strip() == name and len(name) >= 3 for name in names)


def test_brand_override_changes_only_the_brand() -> None:
    factory = default_factory()
    for index in range(30):
        original = factory.make(5, index)
        assert factory.make(5, index, brand=None) == original
        renamed = factory.make(5, index, brand="Qwixel Labs")
        assert renamed.brand == "Qwixel Labs"
        assert (renamed.category, renamed.candidates, renamed.is_secondhand, renamed.image_jpeg) == (
            original.category, original.candidates, original.is_secondhand, original.image_jpeg)
        assert renamed.title == original.title.replace(original.brand, "Qwixel Labs")
        assert "Qwixel Labs" in renamed.title or "Qwixel Labs" in renamed.description


def test_photo_only_condition_drops_the_text_cues_of_second_hand_items() -> None:
    factory = default_factory()
    secondhand_seen = 0
    for index in range(60):
        original = factory.make(5, index)
        varied = factory.make(5, index, photo_only_condition=True)
        # the same product (the text, drawn after the cues, may be worded differently)
        assert (varied.category, varied.brand, varied.is_secondhand) == (
            original.category, original.brand, original.is_secondhand)
        assert varied.category in varied.candidates
        if not original.is_secondhand:
            assert varied == original  # new items have no cue to drop
            continue
        secondhand_seen += 1
        assert not mentions_secondhand(varied.title + " " + varied.description)
        # the photo now carries the sticker: it differs wherever the original had a text cue
        if mentions_secondhand(original.title + " " + original.description):
            assert varied.image_jpeg != original.image_jpeg
    assert secondhand_seen >= 5
    mix = TrainingMix(seed=5, fresh_brand_rate=0.0, photo_only_condition_rate=1.0)
    for index in range(30):
        record = mix.record(factory, index)
        assert not mentions_secondhand(record.title + " " + record.description)


def test_mixture_is_a_function_of_the_index() -> None:
    mix = TrainingMix(seed=41, fresh_brand_rate=0.5)
    factory = default_factory()
    records = [mix.record(factory, index) for index in range(60)]
    assert records[:5] == [mix.record(factory, index) for index in range(5)]
    known = set(brand_names())
    fresh = sum(record.brand not in known for record in records)
    assert 15 <= fresh <= 45  # about half, as asked
    plain = TrainingMix(seed=41, fresh_brand_rate=0.0)
    assert all(plain.record(factory, index).brand in known for index in range(20))


def test_answer_tokens_and_weights(tiny_base: Path) -> None:
    mix = TrainingMix(seed=9, fresh_brand_rate=0.5, brand_weight=4.0, flag_weight=2.0)
    builder = ExampleBuilder(tiny_base, mix)
    for index in range(6):
        record = mix.record(builder.factory, index, builder.brand_words)
        example = builder.example(index)
        tokenizer = builder.tokenizer
        assert example.answer_ids[-1] == builder.end_id
        answer = tokenizer.decode(example.answer_ids[:-1])
        assert json.loads(answer) == {"category": record.category, "brand": record.brand,
                                      "is_secondhand": record.is_secondhand}
        assert answer == answer_text(record.category, record.brand, record.is_secondhand)
        brand_text = weighted_text(builder, example, 4.0)
        assert record.brand in brand_text
        assert "category" not in brand_text
        assert str(record.is_secondhand).lower() in weighted_text(builder, example, 2.0)


def weighted_text(builder: ExampleBuilder, example, weight: float) -> str:
    """The answer tokens that carry loss weight `weight`, decoded."""
    return builder.tokenizer.decode([t for t, w in zip(example.answer_ids, example.answer_weights) if w == weight])


def test_deciding_offset_is_where_the_answer_leaves_its_nearest_candidate() -> None:
    answer = "A > B > Scooter Kits"
    assert deciding_offset(answer, [answer, "A > B > Car Kits", "A > C"]) == len("A > B > ")
    assert deciding_offset(answer, [answer, "Z"]) == 0
    assert deciding_offset(answer, [answer]) == 0


def test_category_weight_falls_on_the_tokens_that_pick_the_candidate(tiny_base: Path) -> None:
    mix = TrainingMix(seed=9, category_weight=3.0, brand_weight=5.0, flag_weight=2.0)
    builder = ExampleBuilder(tiny_base, mix)
    for index in range(8):
        record = mix.record(builder.factory, index, builder.brand_words)
        weighted = weighted_text(builder, builder.example(index), 3.0).strip()
        deciding = deciding_offset(record.category, record.candidates)
        # the weighted tokens cover the category from where it parts from its nearest candidate
        assert record.category.endswith(weighted)
        assert len(weighted) >= len(record.category[deciding:].strip())
        nearest = max((c for c in record.candidates if c != record.category),
                      key=lambda c: deciding_offset(record.category, [c]))
        assert not nearest.endswith(weighted)
    plain = ExampleBuilder(tiny_base, TrainingMix(seed=9, brand_weight=5.0, flag_weight=2.0)).example(0)
    assert set(plain.answer_weights) <= {1.0, 5.0, 2.0}


def test_batch_targets_line_up_with_inputs(tiny_base: Path) -> None:
    builder = ExampleBuilder(tiny_base, TrainingMix(seed=9))
    batch = builder.batch([0, 1, 2])
    input_ids = batch.inputs["input_ids"]  # (3, L)
    assert input_ids.shape[0] == 3
    # the token after each loss position is the target (teacher forcing)
    assert (input_ids[batch.rows, batch.positions + 1] == batch.targets).all()
    for row in range(3):
        length = int(batch.inputs["attention_mask"][row].sum())
        row_positions = batch.positions[batch.rows == row]
        assert int(row_positions.max()) == length - 2  # the last target is the row's last token
    image_tokens = int((input_ids == builder.image_token_id).sum())
    assert image_tokens * 4 == int(batch.inputs["image_grid_thw"].prod(dim=1).sum())  # 2x2 merge


def test_made_up_brands_from_tokenizer_words(tiny_base: Path) -> None:
    builder = ExampleBuilder(tiny_base, TrainingMix(seed=3, fresh_brand_rate=1.0))
    words = builder.brand_words
    assert words and all(word.isalpha() and len(word) >= 3 for word in words)
    vocabulary = set(builder.tokenizer.get_vocab())
    assert all(word in vocabulary or "Ġ" + word in vocabulary for word in words)
    brands = [builder.mix.record(builder.factory, index, words).brand for index in range(20)]
    assert all(any(word.lower() in brand.lower() for word in words) for brand in brands)
    assert len(set(brands)) == 20


def test_listing_text_targets(tiny_base: Path) -> None:
    """Next-token targets cover the listing after the shared system prompt, never image tokens."""
    builder = ExampleBuilder(tiny_base, TrainingMix(seed=9))
    batch = builder.batch([0, 1])
    input_ids = batch.inputs["input_ids"]  # (2, L)
    assert (input_ids[batch.text_rows, batch.text_positions + 1] == batch.text_targets).all()
    assert (batch.text_targets != builder.image_token_id).all()
    assert int(batch.text_positions.min()) == batch.prefix_length  # the prefix itself is not a target
    for row in range(2):
        record = builder.mix.record(builder.factory, row, builder.brand_words)
        text = builder.tokenizer.decode(batch.text_targets[batch.text_rows == row].tolist())
        assert record.title[-12:] in text and record.candidates[0] in text  # (the first token follows the prefix)
        answer_start = int(batch.positions[batch.rows == row].min())
        assert int(batch.text_positions[batch.text_rows == row].max()) < answer_start


@pytest.mark.parametrize(
    ("change", "message"),
    [({"fresh_brand_rate": 5.0}, "fresh_brand_rate must be a share from 0 to 1, got 5.0"),
     ({"realistic_image_rate": -2.0}, "realistic_image_rate must be a share from 0 to 1"),
     ({"photo_only_condition_rate": float("nan")}, "photo_only_condition_rate must be a share"),
     ({"brand_weight": -1.0}, "brand_weight must be a finite number of at least 0, got -1.0"),
     ({"flag_weight": float("nan")}, "flag_weight must be a finite number"),
     ({"category_weight": float("inf")}, "category_weight must be a finite number"),
     ({"prompt_lm_weight": -0.5}, "prompt_lm_weight must be a finite number")],
)
def test_a_mix_out_of_range_is_refused_before_any_work(change, message) -> None:
    """Before, rates of 5 and -2 and a weight of -1 trained and saved a model (loss -0.11); a NaN
    weight stopped the run only after its first step."""
    with pytest.raises(ValueError, match=message):
        TrainingMix(**change)
    for edge in (0.0, 1.0):  # the ends of the ranges are settings (0: never, or no weight)
        assert TrainingMix(**{name: edge for name in change})
