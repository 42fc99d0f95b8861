"""Serving engine: paged KV cache, scheduler, model runner, sampler."""
