"""Images in requests: from a data URI (or an allowed remote URL) to checked file bytes.

The rules, in order:

* `data:image/<fmt>;base64,...` URIs are decoded (`preprocess.image_decode`);
* `http(s)://` URLs are fetched only when their host is in the operator's
  `allowed_image_hosts`, and only if every address the host resolves to is a
  public one (no request forgery towards loopback, private, link-local or
  reserved networks), with a time and a size limit and no redirects;
* anything else (a file path, `file://`, another scheme) is refused: nothing is
  ever read from the local disk.

The bytes are then checked from the header alone (`probe_image_bytes`): the
format, zero sizes, the pixel limit and PIL's decompression-bomb guard, all
before a single pixel is decoded. Pixel data that is corrupt past the header
is found when the engine decodes it, and fails that request alone.
Decoding base64 and probing run in a worker thread, off the event loop.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx

from vlm_catalog.preprocess.image_decode import (
    ImageDecodeError,
    image_bytes_from_input,
    probe_image_bytes,
)
from vlm_catalog.server.errors import APIError, bad_request
from vlm_catalog.server.settings import ServerSettings


def checked_image_bytes(source: str | bytes, max_pixels: int) -> bytes:
    """The image file bytes of a data URI (or of raw bytes), checked from the header; raises ImageDecodeError."""
    raw = image_bytes_from_input(source)
    probe_image_bytes(raw, max_pixels=max_pixels)
    return raw


class ImageResolver:
    def __init__(self, settings: ServerSettings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.allowed_hosts = {host.lower() for host in settings.allowed_image_hosts}
        self.client = client

    async def bytes_of(self, source: str | bytes, param: str) -> bytes:
        """Checked image bytes for an image reference (a URL string, or uploaded bytes); 400 if refused."""
        if isinstance(source, str):
            scheme = source.split(":", 1)[0].lower() if ":" in source else ""
            if scheme in ("http", "https"):
                source = await self._fetch(source, param)
            elif scheme != "data":
                raise bad_request(
                    f"{param}: images must be data:image/<format>;base64 URIs"
                    + (" or http(s) URLs on an allowed host" if self.allowed_hosts else "")
                    + "; file paths and other URLs are never read",
                    param=param, code="image_url_not_allowed",
                )
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(None, checked_image_bytes, source, self.settings.max_image_pixels)
        except ImageDecodeError as exc:
            raise bad_request(f"{param}: {exc}", param=param, code=f"image_{exc.reason.value}") from None

    async def _fetch(self, url: str, param: str) -> bytes:
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise bad_request(f"{param}: invalid URL: {exc}", param=param, code="image_url_invalid") from None
        host = (parsed.host or "").lower()
        if host not in self.allowed_hosts or self.client is None:
            raise bad_request(
                f"{param}: image URLs are only fetched from the operator's allowed hosts "
                f"({host!r} is not one); send the image as a data:image/...;base64 URI",
                param=param, code="image_host_not_allowed",
            )
        await self._refuse_internal_addresses(host, parsed.port or (443 if parsed.scheme == "https" else 80), param)
        limit = self.settings.image_fetch_max_bytes
        try:
            async with asyncio.timeout(self.settings.image_fetch_timeout_s):
                async with self.client.stream("GET", url, follow_redirects=False) as response:
                    if response.status_code != 200:
                        raise bad_request(f"{param}: fetching the image gave HTTP {response.status_code}",
                                          param=param, code="image_fetch_failed")
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > limit:
                            raise bad_request(f"{param}: the image at the URL is larger than {limit} bytes",
                                              param=param, code="image_too_large")
                        chunks.append(chunk)
        except TimeoutError:
            raise bad_request(f"{param}: fetching the image took longer than {self.settings.image_fetch_timeout_s} s",
                              param=param, code="image_fetch_timeout") from None
        except httpx.HTTPError as exc:
            raise bad_request(f"{param}: fetching the image failed: {exc}", param=param,
                              code="image_fetch_failed") from None
        return b"".join(chunks)

    async def _refuse_internal_addresses(self, host: str, port: int, param: str) -> None:
        if self.settings.allow_private_image_addresses:
            return
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError as exc:
            raise bad_request(f"{param}: cannot resolve {host!r}: {exc}", param=param,
                              code="image_fetch_failed") from None
        for info in infos:
            address = ipaddress.ip_address(info[4][0])
            if not address.is_global:
                raise bad_request(
                    f"{param}: {host!r} resolves to the non-public address {address}; not fetched",
                    param=param, code="image_host_not_allowed",
                )


def refuse_too_many_images(count: int, settings: ServerSettings, param: str = "messages") -> None:
    if count > settings.max_images_per_request:
        raise APIError(400, f"the request has {count} images; at most {settings.max_images_per_request} are allowed",
                       param=param, code="too_many_images")
