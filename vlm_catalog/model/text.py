"""Qwen3-VL-MoE text decoder over a flat token batch.

`TextDecoder.forward(input_ids [T], positions [3, T], attention, multimodal)`
runs all layers for the T tokens of many sequences at once; `attention` (an
`AttentionBackend`) owns the KV cache and the per-step layout. Each op calls
one function of the `kernels` package, which picks the Triton kernel on CUDA
and the plain-torch reference elsewhere.

Arithmetic follows transformers' `Qwen3VLMoeTextModel` step for step (RMSNorm
in float32 cast back before the weight, residual adds in the model dtype,
router softmax in float32, deepstack features added after the first layers),
so float32 logits match it to ~1e-5. Two differences in layout, not in maths:
q/k/v projections are fused into one `qkv_proj` matmul and dense MLPs' gate/up
into one `gate_up_proj` (the checkpoint loader concatenates them).

In a W8A8 model the norms before q/k/v and before the experts write those GEMMs'
FP8 inputs themselves where the GEMMs ask for them (`input_layout`, kernels/fp8_input.py):
the same bits the GEMMs' own quantizers would make of the 16-bit rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

import kernels
from kernels.fp8 import FP8_DTYPE, quantize, quantize_experts, requantize
from kernels.fp8_input import Fp8Input, Fp8InputLayout, rows_of
from kernels.moe.grouped_gemm import SortedExpertTerms
from kernels.moe.routing import MoeRouting
from vlm_catalog.model.attention import AttentionBackend
from vlm_catalog.model.config import TextConfig
from vlm_catalog.model.fp8 import Fp8BlockQuantization


@dataclass
class MultimodalEmbeddings:
    """Image features for the image-placeholder tokens of a flat batch.

    `rows [M]` (int64, on the model's device) are the placeholder tokens' rows in
    the flat batch, ascending; `embeddings [M, H]` replace their token
    embeddings in that order; `deepstack[j] [M, H]` is added to those rows
    after decoder layer j. Row indices known on the host, not a boolean mask:
    indexing by a mask on the device waits for the device to count it.
    """

    rows: torch.Tensor
    embeddings: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, quantize: Fp8InputLayout | None = None) -> torch.Tensor | Fp8Input:
        """norm(x); with `quantize` as the next W8A8 GEMM's FP8 input in that layout."""
        return kernels.rms_norm(x, self.weight, self.eps, quantize)

    def add_and_norm(self, x: torch.Tensor | SortedExpertTerms, residual: torch.Tensor,
                     quantize: Fp8InputLayout | None = None) -> tuple[torch.Tensor | Fp8Input, torch.Tensor]:
        """(norm(x + residual), x + residual) in one pass; x [T, H], or [T, K, H] terms (a MoE
        layer's unsummed expert outputs) that the same pass sums first, or such terms left
        where the grouped-GEMM MoE wrote them, which the same pass gathers too. With `quantize`
        the normed rows come as the next W8A8 GEMM's FP8 input in that layout."""
        if isinstance(x, SortedExpertTerms):
            return kernels.gathered_sum_add_rms_norm(x.values, x.rows, x.weights, residual, self.weight, self.eps,
                                                     quantize)
        if x.dim() == 3:
            return kernels.fused_sum_add_rms_norm(x, residual, self.weight, self.eps, quantize)
        return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps, quantize)


class TextAttention(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5
        self.eps = config.rms_norm_eps
        self.mrope_section = config.mrope_section
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def input_layout(self, like: torch.Tensor) -> Fp8InputLayout | None:
        """How q/k/v takes hidden rows like `like` quantized by the norm before it (a W8A8 projection
        on cuBLAS, `Fp8Linear.input_layout`), or None: it takes them in 16 bits."""
        return self.qkv_proj.input_layout(like) if isinstance(self.qkv_proj, Fp8Linear) else None

    def forward(
        self,
        hidden: torch.Tensor | Fp8Input,
        positions: torch.Tensor,
        inv_freq: torch.Tensor,
        attention: AttentionBackend,
    ) -> torch.Tensor:
        """hidden [T, H] (quantized already where `input_layout` asked) -> [T, H]."""
        num_tokens = rows_of(hidden)
        q, k, v = project(self.qkv_proj, hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, Hq, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        # per-head RMSNorm and MRoPE of q and k, applied by the backend (a decode kernel may fuse it)
        qk_norm_rope = kernels.QKNormRope(self.q_norm.weight, self.k_norm.weight, positions, inv_freq,
                                          self.mrope_section, self.eps)
        pieces = attention.attend_rows(self.layer_index, q, k, v, self.scale, qk_norm_rope)  # [T_i, Hq, D] each
        rows = [piece.reshape(piece.shape[0], self.q_size) for piece in pieces]  # [T_i, Hq, D] -> [T_i, Hq * D]
        return project_rows(self.o_proj, rows)  # [T, Hq * D] -> [T, H]


def project(layer: nn.Module, x: torch.Tensor | Fp8Input) -> torch.Tensor:
    """`layer(x)`; a plain `nn.Linear` through `kernels.skinny_linear`, which takes a decode
    batch's few rows to its own kernel on the Triton path (an `Fp8Linear` runs its own GEMMs,
    and takes x quantized already where its `input_layout` asked)."""
    if type(layer) is nn.Linear:
        return kernels.skinny_linear(x, layer.weight, layer.bias)
    return layer(x)


def project_rows(layer: nn.Module, rows: list[torch.Tensor]) -> torch.Tensor:
    """`project` of the row pieces stacked ([T_i, K] each -> [T, N]): an `Fp8Linear` takes them as
    they are (`kernels.fp8_linear_rows`), anything else their concatenation."""
    if len(rows) > 1 and isinstance(layer, Fp8Linear):
        return layer.forward_rows(rows)
    return project(layer, rows[0] if len(rows) == 1 else torch.cat(rows))


def _frozen(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    """An uninitialised parameter that takes no gradient (FP8 weights and their scales)."""
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Fp8Linear(nn.Module):
    """A bias-optional linear layer whose weight [out, in] is float8 e4m3 with float32 block
    scales `weight_scale [out/bn, in/bk]` (vlm_catalog/model/fp8.py), and whose GEMM quantizes
    its input per token and bk columns too ("W8A8", kernels/fp8_linear.py): the decoder's dense
    projections under `quantization="fp8_w8a8"` (or "fp8_w8a8_channel": blocks of one row spanning
    the input, `kernels.fp8.per_channel_block`). Built in place of an `nn.Linear`, on its
    device, with uninitialised tensors the loader fills."""

    def __init__(self, linear: nn.Linear, quantization: Fp8BlockQuantization) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.block = quantization.block
        device = linear.weight.device
        self.weight = _frozen(self.out_features, self.in_features, dtype=FP8_DTYPE, device=device)
        self.weight_scale = _frozen(*quantization.scale_shape(self.out_features, self.in_features),
                                    dtype=torch.float32, device=device)
        self.bias = None if linear.bias is None else _frozen(self.out_features, dtype=linear.bias.dtype, device=device)

    @classmethod
    @torch.no_grad()
    def quantized(cls, linear: nn.Linear, quantization: Fp8BlockQuantization) -> Fp8Linear:
        """`linear`'s present weights quantized (benchmarks with random weights; the loader
        quantizes checkpoints as it reads them)."""
        fp8 = cls(linear, quantization)
        weight, scale = quantize(linear.weight, quantization.block)
        fp8.weight.copy_(weight)
        fp8.weight_scale.copy_(scale)
        if linear.bias is not None:
            fp8.bias.copy_(linear.bias)
        return fp8

    @torch.no_grad()
    def requantize_(self, quantization: Fp8BlockQuantization) -> None:
        """The weight in other blocks (widened exactly, quantized again; benchmarks)."""
        weight, scale = requantize(self.weight, self.weight_scale, self.block, quantization.block)
        self.weight = _frozen(*weight.shape, dtype=FP8_DTYPE, device=weight.device)
        self.weight.copy_(weight)
        self.weight_scale = _frozen(*scale.shape, dtype=torch.float32, device=scale.device)
        self.weight_scale.copy_(scale)
        self.block = quantization.block

    def forward(self, x: torch.Tensor | Fp8Input) -> torch.Tensor:
        return kernels.fp8_linear(x, self.weight, self.weight_scale, self.block, self.bias, fp8_activations=True)

    def input_layout(self, like: torch.Tensor) -> Fp8InputLayout | None:
        """How the GEMM takes rows like `like` (dtype, device) quantized by the kernel before it
        (`kernels.fp8_linear_input_layout`: on cuBLAS), or None: it quantizes them itself."""
        return kernels.fp8_linear_input_layout(like, self.weight, self.weight_scale, self.block)

    def forward_rows(self, rows: list[torch.Tensor]) -> torch.Tensor:
        """`forward` of consecutive row pieces [T_i, K] stacked, without stacking them where the
        GEMM quantizes them anyway: [T, N]."""
        return kernels.fp8_linear_rows(rows, self.weight, self.weight_scale, self.block, self.bias,
                                       fp8_activations=True)


class DenseMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(hidden)))


class MoEExperts(nn.Module):
    """Expert weights in the fused 3-D layout: gate+up `[E, 2I, H]`, down `[E, H, I]`.

    After `use_fp8` they are float8 e4m3 with float32 block scales
    (`gate_up_proj_scale [E, 2I/bn, H/bk]`, `down_proj_scale [E, H/bn, I/bk]`;
    vlm_catalog/model/fp8.py): half the bytes of bfloat16. With `fp8_activations`
    the expert GEMMs quantize their inputs too (kernels/moe/fused_moe.py)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.fp8_block: tuple[int, int] | None = None
        self.fp8_activations = False  # FP8 experts only: quantize the GEMM inputs too ("W8A8")
        self.gate_up_proj_scale: nn.Parameter | None = None
        self.down_proj_scale: nn.Parameter | None = None

    def use_fp8(self, quantization: Fp8BlockQuantization) -> None:
        """Hold the weights in FP8 (new, uninitialised tensors on the same device; the loader fills
        them). The stacked gate/up scales need the intermediate size to be a multiple of block_n."""
        num_experts, two_intermediate, hidden = self.gate_up_proj.shape
        if (two_intermediate // 2) % quantization.block_n:
            raise ValueError(
                f"FP8 experts need the expert intermediate size ({two_intermediate // 2}) to be a multiple "
                f"of the quantization block ({quantization.block_n})"
            )
        device = self.gate_up_proj.device

        def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
            return _frozen(*shape, dtype=dtype, device=device)

        self.gate_up_proj = frozen(num_experts, two_intermediate, hidden, dtype=FP8_DTYPE)
        self.down_proj = frozen(num_experts, hidden, two_intermediate // 2, dtype=FP8_DTYPE)
        self.gate_up_proj_scale = frozen(num_experts, *quantization.scale_shape(two_intermediate, hidden),
                                         dtype=torch.float32)
        self.down_proj_scale = frozen(num_experts, *quantization.scale_shape(hidden, two_intermediate // 2),
                                      dtype=torch.float32)
        self.fp8_block = quantization.block

    @torch.no_grad()
    def quantize_(self, quantization: Fp8BlockQuantization) -> None:
        """Quantize the present weights to FP8 in place, or FP8 weights again in other blocks
        (benchmarks with random weights; the loader quantizes checkpoints as it reads them)."""
        sources = ((self.gate_up_proj, self.gate_up_proj_scale), (self.down_proj, self.down_proj_scale))
        old_block = self.fp8_block
        self.use_fp8(quantization)
        for (source, source_scale), weight, scale in zip(sources, (self.gate_up_proj, self.down_proj),
                                                         (self.gate_up_proj_scale, self.down_proj_scale)):
            if old_block is None:
                quantized, block_scales = quantize_experts(source, quantization.block)
                weight.copy_(quantized)
                scale.copy_(block_scales)
                continue
            for expert in range(source.shape[0]):  # one expert's float32 copy at a time
                quantized, block_scales = requantize(source[expert], source_scale[expert], old_block,
                                                     quantization.block)
                weight[expert].copy_(quantized)
                scale[expert].copy_(block_scales)


class SparseMoE(nn.Module):
    """Softmax router, top-k experts (renormalised when configured), weighted sum of experts."""

    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)
        self.experts = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def gemm_block_size(self, num_tokens: int) -> int:
        """The expert GEMMs' rows per block for `num_tokens` tokens: the routing lays the pairs
        out for it ahead on the Triton path (decode batches)."""
        experts = self.experts
        return kernels.moe_gemm_config(num_tokens, experts.gate_up_proj, self.top_k,
                                       fp8_activations=experts.fp8_activations,
                                       block_shape=experts.fp8_block).block_size_m

    def route(self, hidden: torch.Tensor) -> MoeRouting:
        """The router's logits [T, E] and their top-k: weights in the hidden dtype, as transformers
        casts them for the experts, and for decode batches on the Triton path the pairs' layout
        for the GEMMs, made in the same launch."""
        router_logits = self.gate(hidden)  # [T, E]
        return MoeRouting(*kernels.route_topk_and_align(
            router_logits, self.top_k, self.renormalize, weights_dtype=router_logits.dtype,
            block_size=self.gemm_block_size(hidden.shape[0])))

    def input_layout(self, like: torch.Tensor) -> Fp8InputLayout | None:
        """How the experts take hidden rows like `like` quantized by the norm before them (W8A8
        experts on the Triton path, `kernels.fused_moe_input_layout`), or None."""
        experts = self.experts
        return kernels.fused_moe_input_layout(
            like, experts.gate_up_proj, experts.down_proj, w13_scale=experts.gate_up_proj_scale,
            w2_scale=experts.down_proj_scale, block_shape=experts.fp8_block, fp8_activations=experts.fp8_activations)

    def forward(self, hidden: torch.Tensor | Fp8Input, sum_experts: bool = True,
                routing: MoeRouting | None = None) -> torch.Tensor | SortedExpertTerms:
        """[T, H] -> [T, H]; `sum_experts=False`: on the Triton path, possibly the K weighted
        expert outputs [T, K, H] unsummed, or on the grouped-GEMM path where that path left
        them (`SortedExpertTerms`); `RMSNorm.add_and_norm` sums either. `routing`: `self.route(hidden)`
        made already (`DecoderLayer.add_norm_and_route`, with the norm before it). hidden may come
        quantized already, with its 16-bit rows, where `input_layout` asked."""
        experts = self.experts
        hidden_fp8 = hidden if isinstance(hidden, Fp8Input) else None
        if hidden_fp8 is not None:
            hidden = hidden_fp8.unquantized  # [T, H] 16-bit, which the router reads
        weights, expert_ids, alignment = routing if routing is not None else self.route(hidden)
        return kernels.fused_moe(
            hidden,
            experts.gate_up_proj,
            experts.down_proj,
            weights,
            expert_ids,
            w13_scale=experts.gate_up_proj_scale,
            w2_scale=experts.down_proj_scale,
            block_shape=experts.fp8_block,
            fp8_activations=experts.fp8_activations,
            sum_experts=sum_experts,
            alignment=alignment,
            hidden_fp8=hidden_fp8,
        )


def dense_row_counts(config: TextConfig) -> list[int]:
    """Row counts of the parts fused into the dense projections: q and k/v (of `qkv_proj`), and
    with dense MLP layers the gate/up halves. An FP8 block must divide each (whole scale rows)."""
    counts = [config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim]
    if any(not config.is_moe_layer(index) for index in range(config.num_layers)):
        counts.append(config.intermediate_size)
    return counts


def dense_input_widths(config: TextConfig) -> list[int]:
    """Input widths (the reduction sizes) of the dense projections: q/k/v take the hidden
    state, o the attention heads, and with dense MLP layers down takes the intermediate size."""
    widths = [config.hidden_size, config.num_heads * config.head_dim]
    if any(not config.is_moe_layer(index) for index in range(config.num_layers)):
        widths.append(config.intermediate_size)
    return widths


class DecoderLayer(nn.Module):
    def __init__(self, config: TextConfig, layer_index: int) -> None:
        super().__init__()
        self.self_attn = TextAttention(config, layer_index)
        self.mlp: nn.Module = (
            SparseMoE(config)
            if config.is_moe_layer(layer_index)
            else DenseMLP(config.hidden_size, config.intermediate_size)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def add_norm_and_route(
        self, attention_out: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor | Fp8Input, torch.Tensor, MoeRouting | None]:
        """The post-attention add-and-norm: (normed [T, H], new residual [T, H], and a MoE layer's
        routing, else None). A MoE layer's come from `kernels.add_rms_norm_route`: the norm, the
        router's logits, the top-k and the pairs' layout in one launch for decode batches on the
        Triton path; the normed rows quantized too where the experts ask (`SparseMoE.input_layout`)."""
        norm = self.post_attention_layernorm
        mlp = self.mlp
        if isinstance(mlp, SparseMoE):
            return kernels.add_rms_norm_route(
                attention_out, residual, norm.weight, norm.eps, mlp.gate.weight, mlp.top_k, mlp.renormalize,
                block_size=mlp.gemm_block_size(attention_out.shape[0]), quantize=mlp.input_layout(attention_out))
        return (*norm.add_and_norm(attention_out, residual), None)

    def mlp_terms(self, normed: torch.Tensor | Fp8Input,
                  routing: MoeRouting | None = None) -> torch.Tensor | SortedExpertTerms:
        """The MLP's output [T, H], or a MoE layer's unsummed expert terms ([T, K, H], or
        `SortedExpertTerms` from the grouped-GEMM path) for the next `add_and_norm` to sum in
        its own launch; `routing` as `add_norm_and_route` gave it."""
        if isinstance(self.mlp, SparseMoE):
            return self.mlp(normed, sum_experts=False, routing=routing)
        return self.mlp(normed)


class TextDecoder(nn.Module):
    def __init__(self, config: TextConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.register_buffer("inv_freq", torch.empty(config.head_dim // 2), persistent=False)
        self.reset_rotary_buffers()

    def moe_experts(self) -> list[MoEExperts]:
        return [layer.mlp.experts for layer in self.layers if isinstance(layer.mlp, SparseMoE)]

    def dense_projections(self) -> list[tuple[nn.Module, str]]:
        """(module, attribute) of every dense projection a W8A8 model holds in FP8: attention
        q/k/v and o, dense MLPs' gate/up and down (not the router, embeddings or lm_head)."""
        found = []
        for layer in self.layers:
            found += [(layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj")]
            if isinstance(layer.mlp, DenseMLP):
                found += [(layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj")]
        return found

    def use_fp8_linears(self, quantization: Fp8BlockQuantization, quantize_present: bool = False) -> None:
        """Replace the dense projections by `Fp8Linear`s: uninitialised (the loader fills them),
        or with `quantize_present` the present weights quantized. Fused projections need each
        part's rows to be whole scale blocks."""
        counts = dense_row_counts(self.config)
        if any(count % quantization.block_n for count in counts):
            raise ValueError(f"FP8 dense projections need their fused parts' row counts {counts} to be "
                             f"multiples of the block size {quantization.block_n}")
        build = Fp8Linear.quantized if quantize_present else Fp8Linear
        for module, name in self.dense_projections():
            setattr(module, name, build(getattr(module, name), quantization))

    def reset_rotary_buffers(self) -> None:
        """(Re)compute the float32 rotary frequencies, e.g. after allocating on a device."""
        head_dim = self.config.head_dim
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device=self.inv_freq.device)
        self.inv_freq = 1.0 / (self.config.rope_theta ** (exponents / head_dim))  # [D / 2]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend,
        multimodal: MultimodalEmbeddings | None = None,
    ) -> torch.Tensor:
        """Final-normed hidden states [T, H] for input_ids [T] at positions [3, T]."""
        residual = self.embed_tokens(input_ids)  # [T, H]
        if multimodal is not None and multimodal.embeddings.shape[0]:
            residual = residual.index_copy(0, multimodal.rows, multimodal.embeddings.to(residual.dtype))
        deepstack = multimodal.deepstack if multimodal is not None else []

        first = self.layers[0]
        normed = first.input_layernorm(residual, first.self_attn.input_layout(residual))
        for index, layer in enumerate(self.layers):
            attention_out = layer.self_attn(normed, positions, self.inv_freq, attention)
            normed, residual, routing = layer.add_norm_and_route(attention_out, residual)
            mlp_out = layer.mlp_terms(normed, routing)  # [T, H] or [T, K, H]
            if index + 1 < len(self.layers):  # the next layer's input norm, writing its q/k/v input
                next_layer = self.layers[index + 1]
                next_norm, next_layout = next_layer.input_layernorm, next_layer.self_attn.input_layout(residual)
            else:  # the final norm: the logits' input, in 16 bits
                next_norm, next_layout = self.norm, None
            if index < len(deepstack) and deepstack[index].shape[0]:
                if isinstance(mlp_out, SortedExpertTerms):
                    mlp_out = mlp_out.sum()  # [T, H]
                elif mlp_out.dim() == 3:
                    mlp_out = mlp_out.sum(1)  # [T, K, H] -> [T, H]
                residual = (residual + mlp_out).index_add_(0, multimodal.rows, deepstack[index].to(residual.dtype))
                normed = next_norm(residual, next_layout)
            else:
                normed, residual = next_norm.add_and_norm(mlp_out, residual, next_layout)
        return normed
