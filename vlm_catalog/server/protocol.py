"""Request bodies as pydantic models (strict: a string is not silently a number).

`ChatCompletionRequest` follows OpenAI's chat-completions shape; fields the
engine cannot honour (n > 1, tools, logprobs, penalties) are refused by
`unsupported_fields` rather than ignored. `ExtractRequest` is one product for
`/v1/extract`; unknown fields there are an error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlm_catalog.engine.sampling_params import MAX_SEED, MIN_SEED

MAX_TOKENS_LIMIT = 2**31 - 1


class ImageURL(BaseModel):
    model_config = ConfigDict(strict=True)
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["image_url"]
    image_url: ImageURL | str

    @property
    def url(self) -> str:
        return self.image_url.url if isinstance(self.image_url, ImageURL) else self.image_url


ContentPart = Annotated[TextPart | ImagePart, Field(discriminator="type")]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True)
    # "developer" is OpenAI's newer name for "system"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int | None = Field(None, ge=1, le=1, description="only 1 is supported")
    stream: bool | None = False  # null as OpenAI's API takes it: not streamed
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM's names): top-k and min-p sampling, an answer constrained to a regular expression
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT, description="0 or -1: off")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    guided_regex: str | None = None


# fields OpenAI clients may send that this server cannot honour: refused unless at their neutral value
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
}


def unsupported_fields(request: ChatCompletionRequest) -> list[str]:
    extra = request.model_extra or {}
    return [name for name, neutral in UNSUPPORTED_FIELDS.items() if name in extra and extra[name] not in neutral]


class ExtractRequest(BaseModel):
    """One product: the same fields as `schemas.ProductRecord`, with the image as base64 or a data URI."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    id: str | None = Field(None, description="your record id, echoed as record_id")
    title: str
    description: str
    candidate_categories: list[str] = Field(min_length=1)
    image: str = Field(description="base64 of the image file, or a data:image/...;base64 URI")
    schema_: str = Field("product_metadata", alias="schema", description="a registered schema name")
    prompt_style: Literal["mlperf", "concise"] = "mlperf"
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)


class ExtractBatchRequest(BaseModel):
    """Products are validated one by one, so a bad product fails alone."""

    model_config = ConfigDict(strict=True, extra="forbid")
    products: list[Any] = Field(min_length=1)
