"""Which experts the routers chose: is a model's routing as spread as a trained model's?

A MoE layer's cost depends on its routing. A decode step reads the weights of every
expert its tokens chose, so 256 tokens spread over 128 experts read all of them,
and 256 tokens sent to the same 8 read 1/16 of them. A trained router spreads
tokens (Qwen3's MoE was trained with a load-balancing loss); a random-weight model
need not. The benchmark's random model did not: with every weight at std 0.02 the
residual stream's direction converged across tokens with depth, and from the
middle layers on nearly every token chose the same few experts (`random_model.py`).
Its MoE then cost a fraction of a real model's, and the throughput measured on
it was too high.

`RoutingRecorder` hooks every `SparseMoE` layer and counts, per layer and per
call, the tokens each expert received (top-k of the router's logits, as the
model routes: the routing the layer was given, which the decoder makes with
the post-attention norm, `kernels.add_rms_norm_route`, or else the top-k of
its router's logits). Counts stay on the device until `summary()`. Calls made
while a CUDA graph is being captured are skipped (the hook's ops would be
captured into the graph), and graph replays run no hooks: to count decode
steps on a GPU, run them eagerly (`bench_gpu.py`'s routing pass sets the
engine's decode graphs aside).

`summary()` reports two views:

- calls with at least `SLOTS_PER_EXPERT` expert slots per expert, T * k >= 4E
  (prefill chunks: at 128 experts and top-8, 64 tokens or more): the share of
  all expert slots that went to the k busiest experts, averaged over layers and
  at the worst layer (uniform routing: about k/E), and the busiest expert's load
  over the mean load;
- smaller calls (decode steps of a few tokens): the distinct experts a call's tokens chose,
  averaged over calls and layers, against what uniform routing would touch,
  E * (1 - (1 - k/E)^T).
"""

from __future__ import annotations

import torch

from kernels.fp8_input import Fp8Input
from kernels.moe.align import expert_counts
from vlm_catalog.model.text import SparseMoE

SLOTS_PER_EXPERT = 4  # a call with this many expert slots per expert, or more, is a large call


class RoutingRecorder:
    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = [module for module in model.modules() if isinstance(module, SparseMoE)]
        if not self.routers:
            raise ValueError("the model has no MoE layers to record")
        self.top_k = self.routers[0].top_k
        self.num_experts = self.routers[0].gate.out_features
        # per layer: summed expert loads of the large calls [E] (on the model's device)
        self.large_loads: list[torch.Tensor | None] = [None] * len(self.routers)
        self.num_large_calls = 0
        # per small call and layer: (tokens, distinct experts as a 0-d device tensor)
        self.small_calls: list[tuple[int, torch.Tensor]] = []
        self._handles: list = []

    def __enter__(self) -> RoutingRecorder:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_pre_hook(self._hook(layer), with_kwargs=True))
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def record(module: SparseMoE, args: tuple, kwargs: dict) -> None:
            hidden = args[0] if args else kwargs["hidden"]
            if isinstance(hidden, Fp8Input):  # quantized by the norm before it, as the layer reads it
                hidden = hidden.unquantized  # [T, H] 16-bit, kept for the router
            if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
                return
            routing = kwargs.get("routing", args[2] if len(args) > 2 else None)
            tokens = hidden.shape[0]
            if tokens == 0:
                return
            if routing is not None:  # as the layer was routed
                chosen = routing.ids
            else:  # the layer routes itself: the top-k of its router's logits, as it will
                chosen = module.gate(hidden).detach().topk(self.top_k, dim=-1).indices  # [T, k]
            loads = expert_counts(chosen, self.num_experts)  # [E], without a host sync
            if tokens * self.top_k >= SLOTS_PER_EXPERT * self.num_experts:
                total = self.large_loads[layer]
                self.large_loads[layer] = loads if total is None else total + loads
                if layer == 0:
                    self.num_large_calls += 1
            else:
                self.small_calls.append((tokens, (loads > 0).sum()))
        return record

    def uniform_distinct(self, tokens: int) -> float:
        """Experts that `tokens` tokens touch on average when each picks k of E uniformly."""
        return self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    def summary(self) -> dict:
        k, experts = self.top_k, self.num_experts
        result: dict = {"layers": len(self.routers), "experts": experts, "top_k": k,
                        "uniform_top_k_share": k / experts}
        layer_loads = [loads.float().cpu() for loads in self.large_loads if loads is not None]
        if layer_loads:
            shares = [float(loads.topk(k).values.sum() / loads.sum()) for loads in layer_loads]
            peaks = [float(loads.max() / loads.mean()) for loads in layer_loads]
            result["large_calls"] = {
                "calls": self.num_large_calls,
                "top_k_share": sum(shares) / len(shares),  # the k busiest experts' share of the slots
                "top_k_share_worst_layer": max(shares),
                "max_over_mean_load": sum(peaks) / len(peaks),
                "experts_unused": sum(int((loads == 0).sum()) for loads in layer_loads),  # over all layers
            }
        if self.small_calls:
            distinct = [float(count) for _, count in self.small_calls]
            uniform = [self.uniform_distinct(tokens) for tokens, _ in self.small_calls]
            result["small_calls"] = {
                "calls": len(self.small_calls) // len(self.routers),
                "distinct_experts": sum(distinct) / len(distinct),
                "uniform_distinct_experts": sum(uniform) / len(uniform),
                "distinct_over_uniform": sum(distinct) / sum(uniform),
            }
        return result
