"""The catalogue-ingestion service: REST and OpenAI-compatible APIs over `AsyncLLM` (`vlm-catalog serve`)."""

from vlm_catalog.server.app import create_app
from vlm_catalog.server.settings import ServerSettings

__all__ = ["ServerSettings", "create_app"]
