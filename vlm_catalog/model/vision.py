"""Qwen3-VL vision tower: patch embedding, interpolated position embeddings, 2D rotary
attention within each image, patch merger and deepstack mergers.

Input is the preprocessor's pixel rows of several images concatenated:
`pixel_values [N, C*T*P*P]` in merge-block order (each run of merge^2 rows is
one output token), and `grid_thw [n_images, 3]`. Output is one merged embedding
per group of merge^2 patches `[N / merge^2, out_hidden]`, plus one such tensor
per deepstack layer. Module names follow the checkpoint's (`model.visual.*`).

Speed: the patch embedding (a Conv3d with stride = kernel) runs as one GEMM over
the flattened pixel rows; the per-image tables (interpolated position
embeddings, rotary cos/sin, in merge-block order) are computed once per grid
shape and kept in a small LRU (`GridTableCache`); on CUDA the MLP's bias and GELU
run in its first GEMM's epilogue (`kernels.linear_gelu_tanh`); q and k are rotated in one
Triton pass over the fused qkv projection (`kernels.vision_rotary`); attention
gets the segment lengths on the host and, on CUDA, runs every image in one
FlashAttention varlen launch (or, where torch has none, long images through
SDPA and short ones through one Triton launch), without a device sync
(`kernels.varlen_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from vlm_catalog.device_upload import upload
from vlm_catalog.model.config import VisionConfig
from vlm_catalog.sized_lru import SizedLRU

LAYER_NORM_EPS = 1e-6


@dataclass
class Segments:
    """The attention segments (one per image frame): bounds on the device, lengths on the host."""

    cu_seqlens: torch.Tensor  # [segments + 1] int32
    lengths: list[int]


@dataclass
class VisionOutput:
    embeddings: torch.Tensor  # [N / merge^2, out_hidden]
    deepstack: list[torch.Tensor]  # one [N / merge^2, out_hidden] per deepstack layer


class PatchEmbed(nn.Module):
    """Conv3d with stride = kernel over (temporal, patch, patch), computed as one matmul."""

    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(
            config.in_channels,
            config.hidden_size,
            kernel_size=(config.temporal_patch_size, config.patch_size, config.patch_size),
            stride=(config.temporal_patch_size, config.patch_size, config.patch_size),
            bias=True,
        )

    @property
    def pixel_dtype(self) -> torch.dtype:
        """The dtype pixel rows are cast to before the GEMM: rows already in it give the same output."""
        return self.proj.weight.dtype

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight.view(self.proj.out_channels, -1)  # [hidden, C*T*P*P]
        return F.linear(pixel_values.to(weight.dtype), weight, self.proj.bias)  # [N, hidden]


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.proj = nn.Linear(config.hidden_size, config.hidden_size, bias=True)

    def forward(self, hidden: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_patches = hidden.shape[0]
        qkv = self.qkv(hidden).view(num_patches, 3, self.num_heads, self.head_dim)  # [N, 3, h, d]
        q, k, v = qkv.unbind(dim=1)  # each [N, h, d]
        q, k = kernels.vision_rotary(q, k, cos, sin)  # each [N, h, d], contiguous
        out = kernels.varlen_attention(
            q, k, v, segments.cu_seqlens, self.head_dim**-0.5, max_seqlen=max(segments.lengths), seqlens=segments.lengths
        )  # [N, h, d]
        return self.proj(out.reshape(num_patches, -1))  # [N, hidden]


class VisionMLP(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=True)
        self.linear_fc2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        fc1 = self.linear_fc1
        return self.linear_fc2(kernels.linear_gelu_tanh(hidden, fc1.weight, fc1.bias))  # [N, hidden]


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=LAYER_NORM_EPS)
        self.attn = VisionAttention(config)
        self.mlp = VisionMLP(config)

    def forward(self, hidden: torch.Tensor, segments: Segments, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden = hidden + self.attn(self.norm1(hidden), segments, cos, sin)
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    """Merge each group of merge^2 patches into one token of the text model's width.

    The final merger normalises each patch before concatenating (norm over
    `hidden`); deepstack mergers normalise after (norm over `hidden * merge^2`).
    """

    def __init__(self, config: VisionConfig, norm_after_shuffle: bool) -> None:
        super().__init__()
        self.merged_size = config.hidden_size * config.spatial_merge_size**2
        self.norm_after_shuffle = norm_after_shuffle
        norm_size = self.merged_size if norm_after_shuffle else config.hidden_size
        self.norm = nn.LayerNorm(norm_size, eps=LAYER_NORM_EPS)
        self.linear_fc1 = nn.Linear(self.merged_size, self.merged_size)
        self.linear_fc2 = nn.Linear(self.merged_size, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.norm_after_shuffle:
            merged = self.norm(hidden.view(-1, self.merged_size))  # [N / m^2, hidden * m^2]
        else:
            merged = self.norm(hidden).view(-1, self.merged_size)  # [N / m^2, hidden * m^2]
        return self.linear_fc2(F.gelu(self.linear_fc1(merged)))  # [N / m^2, out_hidden]


class VisionTower(nn.Module):
    def __init__(self, config: VisionConfig) -> None:
        super().__init__()
        self.config = config
        self.patch_embed = PatchEmbed(config)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_shuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, norm_after_shuffle=True) for _ in config.deepstack_visual_indexes
        )
        self.register_buffer("rotary_inv_freq", torch.empty(config.head_dim // 4), persistent=False)
        self.grid_tables = GridTableCache()
        self.reset_rotary_buffers()

    def grid_tables_max_bytes(self) -> int:
        """The device memory `grid_tables` holds when full: per patch a position row in the
        weights' dtype, and its rotary cos and sin in float32."""
        per_patch = (self.config.hidden_size * self.pos_embed.weight.element_size()
                     + 2 * self.config.head_dim * torch.float32.itemsize)
        return self.grid_tables.max_size * per_patch

    def reset_rotary_buffers(self) -> None:
        """(Re)compute the float32 rotary frequencies, e.g. after allocating on a device."""
        rotary_dim = self.config.head_dim // 2
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float32, device=self.rotary_inv_freq.device)
        self.rotary_inv_freq = 1.0 / (self.config.rope_theta ** (exponents / rotary_dim))  # [head_dim / 4]
        self.grid_tables.clear()

    def _tables(self, height: int, width: int) -> GridTables:
        """Position embeddings and rotary cos/sin of one frame of a height x width grid (cached)."""
        weight = self.pos_embed.weight
        # the key names the weights' storage and version: loading new weights invalidates entries
        key = (height, width, weight.device, weight.dtype, weight.data_ptr(), weight._version)
        tables = self.grid_tables.get(key)
        if tables is None:
            rows, cols = patch_coordinates([(1, height, width)], self.config.spatial_merge_size, weight.device)
            cos, sin = self.rotary_cos_sin(rows, cols)  # [h*w, head_dim] float32
            position = self.interpolated_position_embeddings([(1, height, width)], rows, cols)  # [h*w, hidden]
            tables = GridTables(position.to(weight.dtype), cos, sin)
            self.grid_tables.put(key, tables)
        return tables

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> VisionOutput:
        grids = [tuple(int(x) for x in grid) for grid in grid_thw.tolist()]
        expected_rows = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape != (expected_rows, self.config.patch_dim):
            raise ValueError(
                f"pixel_values has shape {tuple(pixel_values.shape)}, the grids need "
                f"({expected_rows}, {self.config.patch_dim})"
            )
        device = pixel_values.device
        frames = [self._tables(h, w) for t, h, w in grids for _ in range(t)]  # one entry per segment
        hidden = self.patch_embed(pixel_values)  # [N, hidden]
        hidden = hidden + _concat([f.position for f in frames]).to(hidden.dtype)
        cos, sin = _concat([f.cos for f in frames]), _concat([f.sin for f in frames])  # [N, head_dim] float32
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        bounds = [0]
        for length in lengths:
            bounds.append(bounds[-1] + length)
        segments = Segments(upload(bounds, device, torch.int32), lengths)  # [segments + 1]

        deepstack: list[torch.Tensor] = []
        for layer_index, block in enumerate(self.blocks):
            hidden = block(hidden, segments, cos, sin)
            if layer_index in self.config.deepstack_visual_indexes:
                merger = self.deepstack_merger_list[
                    self.config.deepstack_visual_indexes.index(layer_index)
                ]
                deepstack.append(merger(hidden))
        return VisionOutput(embeddings=self.merger(hidden), deepstack=deepstack)

    def interpolated_position_embeddings(
        self, grids: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor
    ) -> torch.Tensor:
        """Bilinear (align-corners) resampling of the square learned table to each grid: [N, hidden]."""
        side = int(round(self.config.num_position_embeddings**0.5))
        # each patch's grid height and width, filled on the device: a list copied there, or
        # repeat_interleave by device counts, would make the host wait for the device (most images
        # bring a new grid shape, in the middle of a step the host should run ahead in)
        def per_patch(values: list[int]) -> torch.Tensor:  # one value per grid -> [N]
            return torch.cat([torch.full((t * h * w,), value, device=rows.device)
                              for (t, h, w), value in zip(grids, values)])

        heights, widths = per_patch([h for _, h, _ in grids]), per_patch([w for _, _, w in grids])  # [N] each
        row_taps, row_weights = _bilinear_taps(rows, heights, side)  # [N, 2], [N, 2]
        col_taps, col_weights = _bilinear_taps(cols, widths, side)
        indices = (row_taps[:, :, None] * side + col_taps[:, None, :]).reshape(-1, 4)  # [N, 4]
        weights = (row_weights[:, :, None] * col_weights[:, None, :]).reshape(-1, 4)  # [N, 4]
        table = self.pos_embed(indices)  # [N, 4, hidden]
        return (table * weights[:, :, None].to(table.dtype)).sum(dim=1)  # [N, hidden]

    def rotary_cos_sin(self, rows: torch.Tensor, cols: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """2D rotary angles: row frequencies then column frequencies, repeated twice: [N, head_dim]."""
        freqs_rows = rows[:, None].float() * self.rotary_inv_freq  # [N, head_dim / 4]
        freqs_cols = cols[:, None].float() * self.rotary_inv_freq
        half = torch.cat([freqs_rows, freqs_cols], dim=-1)  # [N, head_dim / 2]
        angles = torch.cat([half, half], dim=-1)  # [N, head_dim]
        return angles.cos(), angles.sin()


@dataclass
class GridTables:
    """Per-frame tables of one grid shape, in the preprocessor's merge-block order."""

    position: torch.Tensor  # [h*w, hidden], the weights' dtype
    cos: torch.Tensor  # [h*w, head_dim] float32
    sin: torch.Tensor  # [h*w, head_dim] float32

    @property
    def num_patches(self) -> int:
        return self.position.shape[0]


class GridTableCache(SizedLRU[GridTables]):
    """`SizedLRU` of `GridTables` by grid shape, bounded in patches (so in memory: at the 30B-A3B
    vision width, 262144 patches are ~0.7 GiB in bf16 with cos/sin); larger tables are not kept."""

    def __init__(self, max_patches: int = 262_144) -> None:
        super().__init__(max_patches, size_of=lambda tables: tables.num_patches)


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def patch_coordinates(
    grids: list[tuple[int, int, int]], merge: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) of every patch, in the preprocessor's merge-block order, all images: [N], [N]."""
    all_rows, all_cols = [], []
    for t, h, w in grids:
        rows = torch.arange(h, device=device)[:, None].expand(h, w)  # [h, w]
        cols = torch.arange(w, device=device)[None, :].expand(h, w)
        for coordinate, out in ((rows, all_rows), (cols, all_cols)):
            blocked = coordinate.reshape(h // merge, merge, w // merge, merge)  # [h/m, m, w/m, m]
            out.append(blocked.permute(0, 2, 1, 3).reshape(-1).repeat(t))  # [t*h*w]
    return torch.cat(all_rows), torch.cat(all_cols)


def _bilinear_taps(
    index: torch.Tensor, size: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two taps into a `side`-long table for positions `index` on axes of length `size`."""
    source = index.float() * (side - 1) / torch.clamp(size - 1, min=1)  # endpoints map to 0, side-1
    floor = torch.floor(source)
    offsets = torch.arange(2, device=index.device)
    taps = (floor.long()[:, None] + offsets).clamp(0, side - 1)  # [N, 2]
    weights = (1 - (source[:, None] - floor[:, None] - offsets).abs()).clamp(min=0)  # [N, 2]
    return taps, weights
