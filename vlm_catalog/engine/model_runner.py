"""Turn a scheduled step into model inputs, run the model, return the logits that sample.

For the chunks of one step the runner builds a flat batch: token ids, MRoPE
positions [3, T], each token's KV slot, padded block tables and per-sequence
lengths. Image placeholder tokens get their features from the encoder cache;
images the step needs that are not cached are decoded and encoded together in
one vision-tower call first (`encode_images`). A chunk may cover part of an
image: it takes the matching rows of that image's features, so prefill chunks
may split an image anywhere. Only the last token of a chunk that completes a
request's tokens produces logits.

The runner reads requests and block tables but never changes them or the
allocator.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from vlm_catalog.engine.cuda_graphs import DecodeGraphRunner
from vlm_catalog.engine.encoder_cache import EncoderCache
from vlm_catalog.engine.paged_attention import (
    DecodeBatch,
    PagedAttention,
    PagedAttentionMetadata,
    PrefillBatch,
)
from vlm_catalog.engine.scheduler import ScheduledChunk
from vlm_catalog.model.qwen3_vl_moe import ImageEmbedding, Qwen3VLMoeModel
from vlm_catalog.model.text import MultimodalEmbeddings
from vlm_catalog.preprocess.image import ImageProbe, ImageProcessor


def order_chunks(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """Decodes (one-token chunks) first, the rest after; stable otherwise."""
    return sorted(chunks, key=lambda chunk: chunk.num_tokens != 1)


class ModelRunner:
    def __init__(
        self,
        model: Qwen3VLMoeModel,
        image_processor: ImageProcessor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        encoder_cache: EncoderCache,
        image_workers: int | None = None,
        graph_runner: DecodeGraphRunner | None = None,
    ) -> None:
        self.model = model
        self.graph_runner = graph_runner
        self.image_processor = image_processor
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.encoder_cache = encoder_cache
        self.device = model.device
        self.image_token_id = model.config.image_token_id
        self._image_pool = ThreadPoolExecutor(image_workers, thread_name_prefix="image-decode")
        self.num_images_encoded = 0

    def close(self) -> None:
        self._image_pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------ vision
    def encode_images(self, chunks: list[ScheduledChunk]) -> tuple[dict[str, ImageEmbedding], dict[str, str]]:
        """Features of every image the chunks touch ({content hash: embedding}), and failures.

        Images not in the encoder cache are decoded in a thread pool and encoded
        in one batch. An image that fails to decode is reported (hash -> error)
        so the engine can fail the requests showing it; the others go on.
        """
        needed: dict[str, ImageProbe] = {}
        for chunk in chunks:
            for image, (span_start, span_length) in zip(chunk.request.prompt.images, chunk.request.prompt.image_spans):
                if span_start < chunk.end and chunk.start < span_start + span_length:
                    needed.setdefault(image.content_hash, image)
        found: dict[str, ImageEmbedding] = {}
        missing: list[ImageProbe] = []
        for content_hash, image in needed.items():
            embedding = self.encoder_cache.get(content_hash)
            if embedding is None:
                missing.append(image)
            else:
                found[content_hash] = embedding
        failures: dict[str, str] = {}
        if missing:
            decoded = list(self._image_pool.map(self._decode, missing))
            ready = [(image, pixels) for image, pixels in zip(missing, decoded) if not isinstance(pixels, str)]
            for image, pixels in zip(missing, decoded):
                if isinstance(pixels, str):
                    failures[image.content_hash] = pixels
            if ready:
                pixel_values = torch.cat([pixels for _, pixels in ready]).to(self.device)
                grids = torch.tensor([image.grid_thw for image, _ in ready], device=self.device)
                for (image, _), embedding in zip(ready, self.model.encode_images(pixel_values, grids)):
                    self.encoder_cache.put(image.content_hash, embedding)
                    found[image.content_hash] = embedding
                    self.num_images_encoded += 1
        return found, failures

    def _attention_metadata(
        self, chunks: list[ScheduledChunk], slots: torch.Tensor, cu_seqlens: list[int], context_lens: list[int]
    ) -> PagedAttentionMetadata:
        device = self.device
        num_decodes = 0
        while num_decodes < len(chunks) and chunks[num_decodes].num_tokens == 1:
            num_decodes += 1
        if any(chunk.num_tokens == 1 for chunk in chunks[num_decodes:]):
            raise ValueError("decode chunks must come first (see order_chunks)")

        def tables(part: list[ScheduledChunk]) -> torch.Tensor:
            width = max(len(chunk.block_table) for chunk in part)
            table = torch.zeros(len(part), width, dtype=torch.int32)
            for row, chunk in enumerate(part):
                table[row, : len(chunk.block_table)] = torch.tensor(chunk.block_table, dtype=torch.int32)
            return table.to(device)

        decode = prefill = None
        if num_decodes:
            decode = DecodeBatch(
                slot_mapping=slots[:num_decodes].to(device),
                block_tables=tables(chunks[:num_decodes]),
                context_lens=torch.tensor(context_lens[:num_decodes], dtype=torch.int32, device=device),
                max_context_len=max(context_lens[:num_decodes]),
            )
        if num_decodes < len(chunks):
            rest = chunks[num_decodes:]
            prefill = PrefillBatch(
                slot_mapping=slots[num_decodes:].to(device),
                block_tables=tables(rest),
                cu_seqlens_q=torch.tensor([c - num_decodes for c in cu_seqlens[num_decodes:]], dtype=torch.int32, device=device),
                context_lens=torch.tensor(context_lens[num_decodes:], dtype=torch.int32, device=device),
                max_query_len=max(chunk.num_tokens for chunk in rest),
            )
        return PagedAttentionMetadata(decode, prefill)

    def _decode(self, image: ImageProbe) -> torch.Tensor | str:
        try:
            processed = self.image_processor.process(image.source)
        except Exception as exc:  # noqa: BLE001 - any decoder failure fails only its requests
            return f"image could not be decoded: {exc}"
        if tuple(processed.grid_thw) != tuple(image.grid_thw):
            return f"image decoded to grid {processed.grid_thw}, its header said {image.grid_thw}"
        return processed.pixel_values

    # -------------------------------------------------------------- text
    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk], images: dict[str, ImageEmbedding]) -> torch.Tensor:
        """Run one step; logits [number of sampling chunks, V] in float32, in chunk order.

        Chunks of one token (decodes) must come first (`order_chunks`).
        """
        device = self.device
        token_ids, positions, slots, sample_rows = [], [], [], []
        multimodal_rows: list[torch.Tensor] = []
        multimodal_parts: list[ImageEmbedding] = []
        cu_seqlens, context_lens = [0], []
        offset = 0
        for chunk in chunks:
            request = chunk.request
            token_ids.append(torch.frombuffer(request.token_ids[chunk.start : chunk.end], dtype=torch.int32))
            positions.append(request.positions(chunk.start, chunk.end))
            table = torch.tensor(chunk.block_table, dtype=torch.int64)
            indices = torch.arange(chunk.start, chunk.end)
            slots.append(table[indices // self.block_size] * self.block_size + indices % self.block_size)
            for image, (span_start, span_length) in zip(request.prompt.images, request.prompt.image_spans):
                first, last = max(chunk.start, span_start), min(chunk.end, span_start + span_length)
                if first < last:
                    multimodal_parts.append(images[image.content_hash].slice(first - span_start, last - span_start))
                    multimodal_rows.append(torch.arange(first - chunk.start, last - chunk.start) + offset)
            offset += chunk.num_tokens
            cu_seqlens.append(offset)
            context_lens.append(chunk.end)
            if chunk.samples:
                sample_rows.append(offset - 1)

        input_ids = torch.cat(token_ids).to(device=device, dtype=torch.int64)
        metadata = self._attention_metadata(chunks, torch.cat(slots), cu_seqlens, context_lens)
        multimodal = None
        if multimodal_parts:
            mask = torch.zeros(offset, dtype=torch.bool)
            mask[torch.cat(multimodal_rows)] = True
            multimodal = MultimodalEmbeddings(
                mask=mask.to(device),
                embeddings=torch.cat([part.embeddings for part in multimodal_parts]),
                deepstack=[
                    torch.cat([part.deepstack[j] for part in multimodal_parts])
                    for j in range(len(multimodal_parts[0].deepstack))
                ],
            )
        positions = torch.cat(positions, dim=1).to(device)
        graphs = self.graph_runner
        if graphs is not None and metadata.prefill is None and multimodal is None and len(chunks) <= graphs.max_batch:
            decode = metadata.decode
            hidden = graphs.run(input_ids, positions, decode.slot_mapping, decode.block_tables, decode.context_lens)
        else:
            hidden = self.model(input_ids, positions, PagedAttention(self.kv_caches, metadata), multimodal)
        if not sample_rows:
            return hidden.new_zeros((0, self.model.config.text.vocab_size), dtype=torch.float32)
        rows = torch.tensor(sample_rows, device=device)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()
