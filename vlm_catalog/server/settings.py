"""The service's settings: one pydantic-settings class, read from `VLM_CATALOG_*` variables.

Every limit that protects the service from bad input or bad traffic lives here,
so an operator can change it without code: `VLM_CATALOG_MAX_BODY_BYTES=...`,
`VLM_CATALOG_API_KEY=...`, `VLM_CATALOG_ALLOWED_IMAGE_HOSTS='["cdn.example.com"]'`.
`vlm-catalog serve` options override the environment.
"""

from __future__ import annotations

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

KIB = 1024
MIB = 1024 * KIB


class ServerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="VLM_CATALOG_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # None: no authentication. Never logged (SecretStr prints as '**********').
    api_key: SecretStr | None = None
    # the model id clients name; None: the checkpoint directory's name
    served_model_name: str | None = None

    # --- bad input
    max_body_bytes: int = Field(32 * MIB, ge=1)
    max_text_field_bytes: int = Field(64 * KIB, ge=1)  # one text field (UTF-8 bytes)
    max_images_per_request: int = Field(8, ge=0)
    max_image_pixels: int = Field(50_000_000, ge=1)  # checked from the header, before any pixel is decoded
    max_batch_products: int = Field(64, ge=1)  # products in one /v1/extract/batch call
    max_stop_strings: int = Field(4, ge=0)
    # hosts image URLs may point at (http/https); empty: only data URIs are accepted
    allowed_image_hosts: list[str] = Field(default_factory=list)
    image_fetch_timeout_s: float = Field(10.0, gt=0)
    image_fetch_max_bytes: int = Field(16 * MIB, ge=1)
    # only for tests against a local file server: allow fetching from private/loopback addresses
    allow_private_image_addresses: bool = False

    # --- generation defaults
    default_max_tokens: int = Field(1024, ge=1)  # chat requests that set no max_tokens
    extract_max_tokens: int = Field(150, ge=1)  # /v1/extract, as `LLM.extract`

    # --- traffic
    # requests allowed to wait beyond the engine's max_num_seqs running ones; past it: 429
    max_waiting_requests: int = Field(512, ge=0)
    retry_after_s: int = Field(1, ge=1)
    request_timeout_s: float = Field(600.0, gt=0)  # for a request's body to arrive, then for its generation
    graceful_shutdown_s: float = Field(5.0, ge=0)  # in-flight requests may finish this long after SIGTERM
    # /health answers 503 while an engine step has run longer than this (a hung device)
    health_step_timeout_s: float = Field(120.0, gt=0)
    # open connections (idle ones too) beyond which uvicorn answers new requests 503; `serve` raises
    # the open-file limit to fit them where it can (a default 1024 let slow clients exhaust it)
    max_connections: int = Field(2048, ge=1)

    @field_validator("api_key", mode="before")
    @classmethod
    def _empty_key_is_none(cls, value: object) -> object:
        """`VLM_CATALOG_API_KEY=` (set but empty) means no key, not the empty key."""
        return None if value in ("", None) else value

    @field_validator("api_key")
    @classmethod
    def _key_a_client_can_send(cls, value: SecretStr | None) -> SecretStr | None:
        """A key must be printable ASCII without spaces at its ends: clients strip the header's spaces,
        and HTTP headers are read as Latin-1, so another key could never match (every request a 401)."""
        if value is None:
            return value
        key = value.get_secret_value()
        if key != key.strip():
            raise ValueError("the API key begins or ends with white space, which no client can send")
        if not all(" " <= character <= "~" for character in key):
            raise ValueError("the API key must be printable ASCII (HTTP headers cannot carry other characters)")
        return value

    @field_validator("host", "served_model_name")
    @classmethod
    def _not_blank(cls, value: str | None, info) -> str | None:
        """An empty host made uvicorn listen on every interface (`--host "$HOST"` with HOST unset);
        an empty model name cannot be requested."""
        if value is not None and not value.strip():
            raise ValueError(f"{info.field_name} must not be empty")
        return value
