"""Chat prompts for catalogue extraction, as OpenAI-style message lists.

The "mlperf" style reproduces the MLPerf reference prompt byte for byte
(`mlcommons/inference`, `multimodal/qwen3-vl`, `task.py`), so that accuracy is
comparable with published results. Its quirks are kept on purpose: the typos
("specifc", "followng"), the candidate list printed with Python's `str(list)`
(single quotes, not JSON) inside a json fence, and the schema printed with
`json.dumps(schema, indent=2)`. One difference by default: the reference
re-encodes the image with PIL before base64; we send the original bytes.
`build_mlperf_messages(..., reencode_image=True)` re-encodes as the reference
does (`reencode_like_reference`), for the LoadGen harness's "mlperf" requests.

The "concise" style is our own shorter prompt (same content, a third of the
system tokens); use it when byte-compatibility with the benchmark is not needed.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Callable
from typing import Any

from PIL import Image, UnidentifiedImageError
from pydantic import BaseModel

from schemas import ProductMetadata, ProductRecord
from vlm_catalog.preprocess.image_decode import DecodeFailure, ImageDecodeError

Messages = list[dict[str, Any]]


class PromptError(ValueError):
    """A record that cannot be turned into a prompt (e.g. an unreadable image)."""


def mlperf_system_prompt(schema: type[BaseModel] = ProductMetadata) -> str:
    field_lines = "\n".join(f"- {name}" for name in schema.model_fields)
    schema_text = json.dumps(schema.model_json_schema(), indent=2)
    return f"""Please analyze the product from the user prompt
and provide the following fields in a valid JSON object:
{field_lines}

You must choose only one, which is the most appropriate, correct, and specifc
category out of the list of possible product categories.

The description of the product sometimes contains various types of source code
(e.g., JavaScript, CSS, HTML, etc.), where useful product information is embedded
somewhere inside the source code. For this task, you should extract the useful
product information from the source code and leverage it, and discard the
programmatic parts of the source code.

Your response should only contain a valid JSON object and nothing more, e.g.,
you should not fence the JSON object inside a ```json code block.
The JSON object should match the followng JSON schema:
```json
{schema_text}
```
"""


def mlperf_user_text(record: ProductRecord) -> str:
    return f"""The title of the product is the following:
```text
{record.title}
```

The description of the product is the following:
```text
{record.description}
```

The following are the possible product categories:
```json
{record.candidate_categories}
```
"""


def image_data_uri(image: bytes) -> str:
    """`data:image/<PIL format>;base64,...` of the original bytes (format as PIL names it)."""
    try:
        with Image.open(io.BytesIO(image)) as opened:
            image_format = opened.format
    except Image.DecompressionBombError as exc:  # PIL's guard fires on the header, before any pixel
        raise ImageDecodeError(DecodeFailure.DECOMPRESSION_BOMB, str(exc)) from None
    except (UnidentifiedImageError, OSError) as exc:
        raise PromptError(f"cannot identify the image format: {exc}") from None
    if image_format is None:
        raise PromptError("cannot identify the image format")
    return f"data:image/{image_format};base64,{base64.b64encode(image).decode('ascii')}"


def reencode_like_reference(image: bytes) -> tuple[str, bytes]:
    """(PIL format, bytes) of `image` saved again in its own format with Pillow's defaults.

    This is what the MLPerf reference harness sends: it calls
    `image.save(buffer, format=image.format)` on the dataset's PIL image, so a
    JPEG is re-compressed at Pillow's default quality (75) and loses its EXIF
    block, and the base64 in the request is of those new bytes.
    """
    try:
        with Image.open(io.BytesIO(image)) as opened:
            image_format = opened.format
            if image_format is None:
                raise PromptError("cannot identify the image format")
            buffer = io.BytesIO()
            opened.save(buffer, format=image_format)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise PromptError(f"cannot re-encode the image as the reference does: {exc}") from None
    return image_format, buffer.getvalue()


def reencoded_image_data_uri(image: bytes) -> str:
    """`data:image/<format>;base64,...` of the image re-encoded as the reference does."""
    image_format, data = reencode_like_reference(image)
    return f"data:image/{image_format};base64,{base64.b64encode(data).decode('ascii')}"


def build_mlperf_messages(
    record: ProductRecord, schema: type[BaseModel] = ProductMetadata, reencode_image: bool = False
) -> Messages:
    """The benchmark's messages: system prompt, then user text and the image.

    With `reencode_image`, the image is re-encoded as the reference harness does
    (`reencode_like_reference`); otherwise its original bytes are sent.
    """
    image_uri = reencoded_image_data_uri(record.image) if reencode_image else image_data_uri(record.image)
    return [
        {"role": "system", "content": mlperf_system_prompt(schema)},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": mlperf_user_text(record)},
                {"type": "image_url", "image_url": {"url": image_uri}},
            ],
        },
    ]


def build_concise_messages(
    record: ProductRecord, schema: type[BaseModel] = ProductMetadata
) -> Messages:
    """A shorter prompt with the same information; the answer is still constrained by schema."""
    fields = ", ".join(schema.model_fields)
    system = (
        f"Extract product metadata as one JSON object with the keys {fields}. "
        "Pick the category from the candidate list exactly as written. "
        "Ignore HTML, CSS and JavaScript in the description. Answer with JSON only."
    )
    candidates = "\n".join(f"- {category}" for category in record.candidate_categories)
    text = (
        f"Title: {record.title}\n\nDescription: {record.description}\n\n"
        f"Candidate categories:\n{candidates}\n"
    )
    return [
        {"role": "system", "content": system},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": text},
                {"type": "image_url", "image_url": {"url": image_data_uri(record.image)}},
            ],
        },
    ]


PROMPT_STYLES: dict[str, Callable[..., Messages]] = {
    "mlperf": build_mlperf_messages,
    "concise": build_concise_messages,
}


def build_messages(
    record: ProductRecord, style: str = "mlperf", schema: type[BaseModel] = ProductMetadata
) -> Messages:
    try:
        builder = PROMPT_STYLES[style]
    except KeyError:
        raise PromptError(
            f"unknown prompt style {style!r}; choose one of {', '.join(PROMPT_STYLES)}"
        ) from None
    return builder(record, schema=schema)
