"""`vlm-catalog serve`: the catalogue-ingestion service on uvicorn.

Loads the model (by default the shipped one, on CPU), starts the engine
thread and the HTTP server, prints the URL once it listens, and on SIGTERM or
SIGINT stops accepting connections, lets in-flight requests finish for
`graceful_shutdown_s`, then answers those still running with a 503 (a stream
with its error event and `[DONE]`), stops the engine and exits 0.

Settings come from `VLM_CATALOG_*` environment variables (`ServerSettings`),
overridden by the options given here. The API key is best given as
`VLM_CATALOG_API_KEY` (command lines are visible to other local users).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

import uvicorn

from vlm_catalog.engine.arguments import DEVICE_OPTIONS, add_device_arguments
from vlm_catalog.error_text import validation_problems
from vlm_catalog.paths import DEFAULT_MODEL_DIR
from vlm_catalog.signals import handling

logger = logging.getLogger("vlm_catalog.server")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", description="Serve /v1/extract, /v1/extract/batch, /v1/chat/completions, /v1/models, /health and /metrics.",
    )
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR, help="checkpoint directory")
    parser.add_argument("--served-model-name", default=None, help="model id clients use (default: the directory name)")
    parser.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default 8000; 0: any free port)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' (default: $VLM_CATALOG_API_KEY, else none)")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-num-seqs", type=int, default=None, help="requests computed together")
    engine.add_argument("--max-num-batched-tokens", type=int, default=None, help="tokens per step")
    engine.add_argument("--max-model-len", type=int, default=None)
    engine.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="KV pool size (CPU default 256 MiB)")
    add_device_arguments(engine)
    engine.add_argument("--no-prefix-caching", action="store_true")
    engine.add_argument("--policy", default="fcfs", choices=("fcfs", "shortest_prompt_first"))
    limits = parser.add_argument_group(
        "limits (also from VLM_CATALOG_MAX_WAITING_REQUESTS, VLM_CATALOG_REQUEST_TIMEOUT_S, VLM_CATALOG_MAX_BODY_BYTES, "
        "VLM_CATALOG_MAX_IMAGES_PER_REQUEST, VLM_CATALOG_MAX_CONNECTIONS and VLM_CATALOG_ALLOWED_IMAGE_HOSTS, a JSON "
        "list; docs/service.md)"
    )
    limits.add_argument("--max-waiting-requests", type=int, default=None,
                        help="requests queued beyond --max-num-seqs before 429 (default 512)")
    limits.add_argument("--request-timeout", type=float, default=None, dest="request_timeout_s",
                        help="seconds one request may take (default 600)")
    limits.add_argument("--max-body-bytes", type=int, default=None, help="default 32 MiB")
    limits.add_argument("--max-images-per-request", type=int, default=None, help="default 8")
    limits.add_argument("--max-connections", type=int, default=None,
                        help="open connections before new requests get 503 (default 2048)")
    limits.add_argument("--allowed-image-host", action="append", default=None, dest="allowed_image_hosts",
                        help="a host image URLs may be fetched from (repeatable; default: data URIs only)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    parser.set_defaults(handler=run)


SETTING_OPTIONS = ("host", "port", "api_key", "served_model_name", "max_waiting_requests", "request_timeout_s",
                   "max_body_bytes", "max_images_per_request", "max_connections", "allowed_image_hosts")
# open files the process keeps beyond its connections: the model's files, logs, the engine's threads
SPARE_FILE_DESCRIPTORS = 256
ENGINE_OPTIONS = ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory_bytes", *DEVICE_OPTIONS)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError
    from pydantic_settings import SettingsError as PydanticSettingsError

    from vlm_catalog.engine.async_engine import AsyncLLM
    from vlm_catalog.engine.config import EngineConfigError
    from vlm_catalog.model.config import ModelConfigError
    from vlm_catalog.model.loader import CheckpointError
    from vlm_catalog.server.app import create_app
    from vlm_catalog.server.settings import ServerSettings

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key == "":  # `--api-key "$KEY"` with KEY unset: it would turn off $VLM_CATALOG_API_KEY's key
        print("error: --api-key is empty; give the key, or leave the option out (then $VLM_CATALOG_API_KEY "
              "gives it, or the service runs without one)", file=sys.stderr)
        return 2
    try:
        settings = ServerSettings(**{name: getattr(args, name) for name in SETTING_OPTIONS
                                     if getattr(args, name) is not None})
    except ValidationError as exc:
        print(f"error: {validation_problems(exc, whole='settings')}", file=sys.stderr)
        return 2
    except PydanticSettingsError as exc:  # a VLM_CATALOG_* variable that cannot be read (a list not in JSON)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    engine_options = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    # the engine takes as many images per prompt as a request may carry (its memory profile counts them)
    engine_options["max_images_per_prompt"] = max(1, settings.max_images_per_request)
    try:
        engine = AsyncLLM(model=args.model, device=args.device, dtype=args.dtype,
                          enable_prefix_caching=not args.no_prefix_caching, scheduling_policy=args.policy,
                          **engine_options)
    except (CheckpointError, ModelConfigError, EngineConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        app = create_app(engine, settings)
        # uvicorn's own deadline, which cancels the handlers (a bare 500, a stream cut short), only backs up ours
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=args.log_level,
                                timeout_graceful_shutdown=settings.graceful_shutdown_s + ANSWERING_S, lifespan="on",
                                limit_concurrency=connection_limit(settings.max_connections))
        server = AnnouncingServer(config, app.state.service.model_name, settings.api_key is not None,
                                  engine, settings.graceful_shutdown_s)
        with _signals_stop(server):
            server.run()
    finally:
        engine.shutdown()
    return 0


ANSWERING_S = 2.0  # after the grace period, for the aborted requests' 503s to be written


def connection_limit(max_connections: int) -> int:
    """uvicorn's `limit_concurrency` for `max_connections`: the soft open-file limit is raised (up to
    the hard one) to hold them and `SPARE_FILE_DESCRIPTORS`; where it cannot be, the connections
    are cut to what it holds, with a warning. Past the limit uvicorn answers new requests 503, where
    before, 1,100 half-sent bodies under the usual 1,024 exhausted the files: `accept()` failed in a
    loop (220,000 log lines) and /health timed out."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + SPARE_FILE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fitting = max(1, soft - SPARE_FILE_DESCRIPTORS)
        print(f"warning: the open-file limit ({soft}) holds {fitting} connections, not --max-connections "
              f"{max_connections}; raise it (ulimit -n) to serve more", file=sys.stderr)
        return fitting
    return max_connections


class AnnouncingServer(uvicorn.Server):
    """uvicorn's Server that prints the URL once it listens (the real port, also for --port 0),
    and, shutting down, aborts through the engine (`AsyncLLM.fail_all`) the requests still running
    after `grace_s`, so each is answered as an API error."""

    def __init__(self, config: uvicorn.Config, model_name: str, keyed: bool, engine=None, grace_s: float = 0.0) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.keyed = keyed
        self.engine, self.grace_s = engine, grace_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed_now = False

    async def shutdown(self, sockets=None) -> None:
        deadline = None
        if self.engine is not None:
            reason = (f"the server is shutting down: the request was still running {self.grace_s:g} s after the "
                      "signal (graceful_shutdown_s) and was aborted")
            deadline = asyncio.get_running_loop().call_later(self.grace_s, self.engine.fail_all, reason)
        try:
            await super().shutdown(sockets)
        finally:
            if deadline is not None:
                deadline.cancel()

    def handle_exit(self, sig: int, frame) -> None:
        """A second SIGINT made uvicorn cut the running requests off (a bare 500, a traceback): the
        engine now answers them at once (503, as at the end of the grace period); a third forces the exit."""
        if (sig == signal.SIGINT and self.should_exit and self.engine is not None and self._loop is not None
                and not self._failed_now):
            self._failed_now = True
            self._captured_signals.append(sig)
            reason = "the server is shutting down now (a second signal): the request was aborted"
            self._loop.call_soon_threadsafe(self.engine.fail_all, reason)  # from the loop, not the signal handler
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            auth = " (API key required)" if self.keyed else ""
            print(f"vlm-catalog serving {self.model_name!r} at http://{shown}:{port}{auth}", flush=True)


def _signals_stop(server: uvicorn.Server):
    """Let SIGTERM, SIGINT and SIGHUP stop the server gracefully and the process exit 0.

    uvicorn re-raises the signal that stopped it once it has shut down; with
    these handlers in place that re-raise only asks the (stopped) server to
    exit again instead of killing the process before the engine is shut down.
    uvicorn handles SIGTERM and SIGINT while it runs; SIGHUP (the terminal
    closed) reaches the handler here, which drains the same way (before, it
    killed the process at once), unless it is ignored, as under nohup.
    """
    stopping = [signal.SIGTERM, signal.SIGINT]
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup the server outlives the terminal
        stopping.append(signal.SIGHUP)

    def stop(signum, frame) -> None:
        server.should_exit = True

    return handling(stopping, stop)
