"""Our prompt processor against transformers' Qwen3-VL processor and rope index."""

import base64

import pytest
import torch
from PIL import Image

from tests.model.helpers import build_checkpoint, noise_image
from vlm_catalog.bench.baselines import transformers_processor
from vlm_catalog.model.config import ModelConfig
from vlm_catalog.preprocess.mrope import mrope_positions
from vlm_catalog.preprocess.processor import PromptError, PromptProcessor


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from vlm_catalog.model.tiny_checkpoint import build_tokenizer

    return build_checkpoint(tmp_path_factory.mktemp("proc") / "tiny", build_tokenizer(800), seed=4)


@pytest.fixture(scope="module")
def processor(checkpoint):
    return PromptProcessor.from_pretrained(checkpoint, image_token_id=ModelConfig.from_pretrained(checkpoint).image_token_id)


def messages_with_images(images):
    jpeg_uri = "data:image/JPEG;base64," + base64.b64encode(images[1]).decode()
    return [
        {"role": "system", "content": "You extract product metadata."},
        {"role": "user", "content": [
            {"type": "text", "text": "Look at these:"},
            {"type": "image", "image": images[0]},
            {"type": "image_url", "image_url": {"url": jpeg_uri}},
            {"type": "text", "text": "Which category?"},
        ]},
    ]


def test_same_tokens_pixels_grids_and_positions_as_transformers(processor, checkpoint):
    from transformers import Qwen3VLMoeConfig
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import Qwen3VLMoeModel

    images = [noise_image(150, 70, seed=1), noise_image(90, 260, seed=2, fmt="JPEG")]
    prompt = processor.process(messages_with_images(images))
    text, _ = processor.render(messages_with_images(images))
    pil_images = [Image.open(__import__("io").BytesIO(b)).convert("RGB") for b in images]
    expected = transformers_processor(processor.image_processor, processor.tokenizer)(text=[text], images=pil_images, return_tensors="pt")

    assert prompt.token_ids.tolist() == expected["input_ids"][0].tolist()
    assert prompt.token_ids.itemsize == 4  # held compactly: 4 bytes per token, not a list of ints
    assert [list(image.grid_thw) for image in prompt.images] == expected["image_grid_thw"].tolist()
    pixels, grids = processor.load_pixels(prompt.images)
    assert grids.tolist() == expected["image_grid_thw"].tolist()
    assert (pixels - expected["pixel_values"]).abs().max() <= 1e-5

    hf_model = Qwen3VLMoeModel(Qwen3VLMoeConfig.from_pretrained(checkpoint))
    positions, deltas = hf_model.get_rope_index(
        expected["input_ids"], expected["mm_token_type_ids"], image_grid_thw=expected["image_grid_thw"]
    )
    assert torch.equal(prompt.positions, positions[:, 0])
    assert prompt.mrope_delta == int(deltas[0, 0])


def test_mrope_positions_by_hand():
    # 2 text tokens, an image of merged grid 2 x 3 (patch grid 4 x 6), 1 text token
    positions, delta = mrope_positions(9, [(2, 6)], [(1, 4, 6)], merge_size=2)
    assert positions.tolist() == [
        [0, 1, 2, 2, 2, 2, 2, 2, 5],
        [0, 1, 2, 2, 2, 3, 3, 3, 5],
        [0, 1, 2, 3, 4, 2, 3, 4, 5],
    ]
    assert delta == 5 + 1 - 9  # the text after the image resumes at 2 + max(2, 3)
    text_only, text_delta = mrope_positions(4, [], [], merge_size=2)
    assert text_only.tolist() == [[0, 1, 2, 3]] * 3 and text_delta == 0
    with pytest.raises(ValueError, match="does not fit grid"):
        mrope_positions(9, [(2, 5)], [(1, 4, 6)], merge_size=2)


def test_special_token_strings_in_text_stay_text(processor):
    tokenizer = processor.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    image_pad = processor.image_token_id
    clean = processor.process([{"role": "user", "content": "hello"}])
    tricky = processor.process([{"role": "user", "content": "hello <|im_end|> and <|image_pad|>"}])
    assert tricky.token_ids.count(im_end) == clean.token_ids.count(im_end)
    assert image_pad not in tricky.token_ids and not tricky.images


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "non-empty list"),
        ([{"role": "user"}], "'role' and 'content'"),
        ([{"role": "user", "content": [{"type": "audio"}]}], "unsupported content part type 'audio'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.jpg"}}]}], "remote image URLs"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "needs a 'url'"),
        ([{"role": "user", "content": 42}], "string or a list"),
    ],
)
def test_bad_messages_are_named(processor, messages, message):
    with pytest.raises(PromptError, match=message):
        processor.process(messages)


def test_undecodable_image_fails_with_the_decoder_error(processor):
    from vlm_catalog.preprocess.image_decode import ImageDecodeError

    with pytest.raises(ImageDecodeError):  # refused from the header, before any pixel work
        processor.process([{"role": "user", "content": [{"type": "image", "image": b"not an image"}]}])
    whole = noise_image(64, 64, seed=5, fmt="JPEG")
    truncated = whole[: len(whole) * 2 // 3]
    prompt = processor.process([{"role": "user", "content": [{"type": "image", "image": truncated}]}])
    with pytest.raises(ImageDecodeError):  # corrupt pixel data shows only when decoding
        processor.load_pixels(prompt.images)


def test_prompt_holds_no_pixels_and_computes_positions_lazily(processor):
    prompt = processor.process(messages_with_images([noise_image(150, 70, seed=1), noise_image(90, 260, seed=2, fmt="JPEG")]))
    assert all(isinstance(image.source, bytes) for image in prompt.images)
    assert "positions" not in prompt.__dict__
    full, delta = mrope_positions(prompt.num_tokens, prompt.image_spans, [i.grid_thw for i in prompt.images], 2)
    assert torch.equal(prompt.positions, full) and prompt.mrope_delta == delta
    prompt.release_positions()
    assert "positions" not in prompt.__dict__
