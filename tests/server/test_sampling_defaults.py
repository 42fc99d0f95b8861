"""Chat requests take the checkpoint's sampling settings where they name none (as vLLM does)."""

from __future__ import annotations

import asyncio
import dataclasses

from vlm_catalog.engine.generation_config import Sampling
from vlm_catalog.server.chat import sampling_params
from vlm_catalog.server.protocol import ChatCompletionRequest

from .conftest import chat_body


def params_for(app, defaults: Sampling, **fields):
    state = dataclasses.replace(app.state.service, default_sampling=defaults)
    return asyncio.run(sampling_params(state, ChatCompletionRequest.model_validate(chat_body(**fields))))


def test_the_checkpoints_settings_are_the_defaults(app):
    qwen = Sampling(temperature=0.7, top_p=0.8, top_k=20)
    params = params_for(app, qwen)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.7, 0.8, 20, 0.0)


def test_a_requests_own_settings_win(app):
    params = params_for(app, Sampling(temperature=0.7, top_p=0.8, top_k=20), temperature=0.0, top_p=1.0, top_k=-1,
                        min_p=0.05)
    assert (params.temperature, params.top_p, params.top_k, params.min_p) == (0.0, 1.0, 0, 0.05)


def test_the_shipped_model_is_greedy_by_default(app):
    params = params_for(app, app.state.service.default_sampling)
    assert params.temperature == 0.0
