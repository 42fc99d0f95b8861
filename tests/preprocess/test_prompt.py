"""The mlperf prompt, byte for byte as the MLPerf reference builds it."""

import base64

import pytest

from schemas import ProductDetails, ProductRecord
from tests.conftest import jpeg_bytes, png_bomb
from vlm_catalog.preprocess.prompt import PromptError, build_messages

EXPECTED_SYSTEM = '''Please analyze the product from the user prompt
and provide the following fields in a valid JSON object:
- category
- brand
- is_secondhand

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
{
  "additionalProperties": false,
  "description": "Json format for the expected responses from the VLM.",
  "properties": {
    "category": {
      "description": "The complete category of the product, e.g.,\\n\\"Clothing & Accessories > Clothing > Shirts > Polo Shirts\\".\\nEach categorical level is separated by \\" > \\".",
      "title": "Category",
      "type": "string"
    },
    "brand": {
      "description": "The brand of the product, e.g., \\"giorgio armani\\".",
      "title": "Brand",
      "type": "string"
    },
    "is_secondhand": {
      "description": "True if the product is second-hand, False otherwise.",
      "title": "Is Secondhand",
      "type": "boolean"
    }
  },
  "required": [
    "category",
    "brand",
    "is_secondhand"
  ],
  "title": "ProductMetadata",
  "type": "object"
}
```
'''

EXPECTED_USER_TEXT = """The title of the product is the following:
```text
Men's "Classic" Polo
```

The description of the product is the following:
```text
<p>Soft cotton polo by Zed.</p>
```

The following are the possible product categories:
```json
['Apparel & Accessories > Clothing > Shirts & Tops', "Kids' Clothing > Tops"]
```
"""


@pytest.fixture
def record():
    return ProductRecord(
        id="7",
        title='Men\'s "Classic" Polo',
        description="<p>Soft cotton polo by Zed.</p>",
        image=jpeg_bytes((10, 20, 30)),
        candidate_categories=["Apparel & Accessories > Clothing > Shirts & Tops", "Kids' Clothing > Tops"],
    )


def test_mlperf_prompt_is_byte_exact(record):
    system, user = build_messages(record, style="mlperf")
    assert system == {"role": "system", "content": EXPECTED_SYSTEM}
    assert user["role"] == "user"
    text_part, image_part = user["content"]
    assert text_part == {"type": "text", "text": EXPECTED_USER_TEXT}
    url = image_part["image_url"]["url"]
    prefix = "data:image/JPEG;base64,"
    assert image_part["type"] == "image_url" and url.startswith(prefix)
    assert base64.b64decode(url[len(prefix):]) == record.image  # original bytes, not re-encoded


def test_richer_schema_lists_its_fields(record):
    system = build_messages(record, schema=ProductDetails)[0]["content"]
    assert "- colour\n- material\n- target_gender\n- age_group\n- condition\n" in system
    assert '"title": "ProductDetails"' in system


def test_concise_style_and_errors(record):
    system, user = build_messages(record, style="concise")
    assert "category, brand, is_secondhand" in system["content"]
    assert "- Kids' Clothing > Tops" in user["content"][0]["text"]
    with pytest.raises(PromptError, match="unknown prompt style 'fancy'"):
        build_messages(record, style="fancy")
    broken = record.model_copy(update={"image": b"GIF89a broken"})
    with pytest.raises(PromptError, match="image format"):
        build_messages(broken)


def test_a_decompression_bomb_is_an_image_error_not_pils():
    """PIL's own guard fires when the header is opened; it reaches callers as our ValueError."""
    from vlm_catalog.preprocess.image_decode import DecodeFailure, ImageDecodeError
    from vlm_catalog.preprocess.prompt import image_data_uri

    with pytest.raises(ImageDecodeError) as raised:
        image_data_uri(png_bomb())
    assert raised.value.reason is DecodeFailure.DECOMPRESSION_BOMB and "pixels" in str(raised.value)
