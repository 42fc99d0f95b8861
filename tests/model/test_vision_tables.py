"""The vision tower's per-grid tables: cached per grid shape (bounded LRU), invalidated by
new weights, and the attention gets the segment lengths on the host."""

import torch

from vlm_catalog.model.config import VisionConfig
from vlm_catalog.model.vision import GridTableCache, GridTables, VisionTower


def tiny_tower(seed: int = 0) -> VisionTower:
    torch.manual_seed(seed)
    config = VisionConfig(
        depth=2, hidden_size=32, intermediate_size=48, num_heads=2, in_channels=3, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16,
        deepstack_visual_indexes=(0,), hidden_act="gelu_pytorch_tanh", rope_theta=10000.0,
    )
    tower = VisionTower(config)
    with torch.no_grad():
        for parameter in tower.parameters():
            parameter.normal_(0, 0.3)
    return tower


def images(grids: list[tuple[int, int, int]], patch_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows = sum(t * h * w for t, h, w in grids)
    return torch.randn(rows, patch_dim), torch.tensor(grids)


def test_tables_are_computed_once_per_grid_shape_and_give_the_same_output():
    tower = tiny_tower()
    pixels, grids = images([(1, 4, 6), (1, 8, 4), (1, 4, 6), (2, 4, 6)], tower.config.patch_dim)
    cold = tower(pixels, grids)
    assert (len(tower.grid_tables), tower.grid_tables.misses) == (2, 2)  # (4, 6) and (8, 4)
    warm = tower(pixels, grids)
    assert tower.grid_tables.misses == 2
    assert torch.equal(cold.embeddings, warm.embeddings)
    uncached = tiny_tower()  # same weights, a fresh cache, one image at a time
    separately = torch.cat([
        uncached(pixels[start:start + t * h * w], torch.tensor([[t, h, w]])).embeddings
        for start, (t, h, w) in zip([0, 24, 56, 80], [(1, 4, 6), (1, 8, 4), (1, 4, 6), (2, 4, 6)])
    ])
    # tolerance: float32 noise. The batched and the one-image runs multiply matrices of other row
    # counts, which BLAS may sum in other orders (on an AMD EPYC host one element of 1280 moved by
    # 3.6e-6, 2.6e-5 relative); a wrong table moves every row of its image by O(1)
    torch.testing.assert_close(cold.embeddings, separately, rtol=1e-4, atol=1e-5)


def test_new_weights_invalidate_the_tables():
    tower, other = tiny_tower(0), tiny_tower(1)
    pixels, grids = images([(1, 4, 4)], tower.config.patch_dim)
    tower(pixels, grids)
    with torch.no_grad():
        for mine, theirs in zip(tower.parameters(), other.parameters()):
            mine.copy_(theirs)
    assert torch.equal(tower(pixels, grids).embeddings, other(pixels, grids).embeddings)


def test_cache_is_bounded_in_patches_and_evicts_least_recently_used():
    def tables(patches: int) -> GridTables:
        return GridTables(torch.zeros(patches, 2), torch.zeros(patches, 4), torch.zeros(patches, 4))

    cache = GridTableCache(max_patches=100)
    cache.put("a", tables(40))
    cache.put("b", tables(40))
    assert cache.get("a") is not None  # "b" is now the least recently used
    cache.put("c", tables(40))
    assert cache.get("b") is None and cache.get("a") is not None and cache.get("c") is not None
    cache.put("huge", tables(101))
    assert cache.get("huge") is None and len(cache) == 2


def test_attention_gets_host_segment_lengths(monkeypatch):
    import kernels

    seen = []
    real = kernels.varlen_attention

    def recording(q, k, v, cu_seqlens, scale, **kwargs):
        seen.append(kwargs)
        return real(q, k, v, cu_seqlens, scale, **kwargs)

    monkeypatch.setattr(kernels, "varlen_attention", recording)
    tower = tiny_tower()
    pixels, grids = images([(2, 4, 6), (1, 8, 4)], tower.config.patch_dim)
    tower(pixels, grids)
    assert seen and all(call["seqlens"] == [24, 24, 32] and call["max_seqlen"] == 32 for call in seen)
