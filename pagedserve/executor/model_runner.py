"""Turns a SchedulerOutput into tensors, runs the model, samples. Owns the model and the KV-cache tensors."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedserve.attention.kv_layout import key_cache_shape, value_cache_shape
from pagedserve.attention.metadata import AttentionMetadata, DecodeBatch, PrefillSeq
from pagedserve.config import CacheConfig
from pagedserve.core.scheduler_output import ScheduledRequest, SchedulerOutput
from pagedserve.executor.cpu_allocator import huge_page_zeros, keep_freed_memory, mem_available
from pagedserve.executor.forward_context import set_forward_context
from pagedserve.executor.kv_commit import KVCommitter
from pagedserve.layers.sampler import Sampler, SamplingMetadata
from pagedserve.loader.model_loader import LoadedModel
from pagedserve.lora.manager import LoRAManager
from pagedserve.lora.mapping import LoRAMapping
from pagedserve.lora.model_slots import ModelLoRASlots
from pagedserve.quantization import kv_cache as kv_quant
from pagedserve.structured_output.bitmask import apply_grammar_bitmask

logger = logging.getLogger(__name__)

LOGPROB_FLOOR = -9999.0
"""The lowest logprob reported (a token the grammar bans, or one with probability 0)."""
CPU_DEFAULT_KV_SHARE = 0.25
CPU_DEFAULT_KV_CAP = 4 << 30
CUDA_DEFAULT_KV_SHARE = 0.8


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, list[tuple[int, float, int]]] = field(default_factory=dict)
    """For requests that asked for logprobs: (token_id, logprob, rank) of the sampled token first, then the
    top-N tokens in order."""


class ModelRunner:
    def __init__(self, loaded: LoadedModel, cache_config: CacheConfig,
                 lora_manager: Optional[LoRAManager] = None) -> None:
        """With `lora_manager`, the model's linears get max_loras LoRA slots, filled from its adapters as
        the scheduler assigns them (SchedulerOutput.lora_slots)."""
        self.model = loaded.model
        self.device = loaded.device
        if self.device.type == "cpu":
            keep_freed_memory()
        self.dtype = loaded.dtype
        self.block_size = cache_config.block_size
        self.sampler = Sampler()
        self._generators: dict[str, torch.Generator] = {}
        attn = self.model.model.layers[0].self_attn
        self.num_layers = len(self.model.model.layers)
        self.num_kv_heads = attn.num_kv_heads
        self.kv_shape_tail = (attn.num_kv_heads, self.block_size, attn.head_dim)
        self.kv_cache_dtype = kv_quant.kv_storage_dtype(cache_config.kv_cache_dtype, self.dtype)
        self.num_blocks = self._num_blocks(cache_config.kv_cache_memory_bytes)
        self.kv_caches, self.kv_scales = self._allocate_kv_cache()
        self.kv_commit: Optional[KVCommitter] = None
        """Commits the CPU cache's pages (none are yet): the engine decides when (EngineCore)."""
        if self.device.type == "cpu":
            tensors = [t for pair in self.kv_caches + (self.kv_scales or []) for t in pair]
            self.kv_commit = KVCommitter(tensors, self.num_blocks)
        self.model.bind_kv_cache(self.kv_caches, self.kv_scales)
        if self.device.type == "cpu":
            start = time.perf_counter()
            packed = self.model.pack_for_small_batches()
            if packed:
                logger.info("packed %d weight matrices for the CPU matmul kernels in %.2f s", packed,
                            time.perf_counter() - start)
        self.lora_manager = lora_manager
        self.lora_slots: Optional[ModelLoRASlots] = None
        if lora_manager is not None:
            config = lora_manager.config
            self.lora_slots = ModelLoRASlots(self.model, config.max_loras, config.max_lora_rank, self.dtype,
                                             self.device)
            logger.info("LoRA: %d slots of rank up to %d (%.1f MiB)", config.max_loras, config.max_lora_rank,
                        self.lora_slots.num_bytes / 2**20)

    # -- KV-cache sizing ---------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block: elements, plus a bf16 scale per (token, head) when 8-bit."""
        h, b, d = self.kv_shape_tail
        per_token_head = d * self.kv_cache_dtype.itemsize
        if kv_quant.is_quantized(self.kv_cache_dtype):
            per_token_head += kv_quant.SCALE_DTYPE.itemsize
        return 2 * self.num_layers * b * h * per_token_head

    def _allocate_kv_cache(self):
        """Per layer (key, value) cache tensors, and for an 8-bit cache their (key, value) scales (else None)."""
        dtype = self.kv_cache_dtype
        key_shape = key_cache_shape(self.num_blocks, *self.kv_shape_tail, dtype)
        value_shape = value_cache_shape(self.num_blocks, *self.kv_shape_tail)
        caches = [(_zeros(key_shape, dtype, self.device), _zeros(value_shape, dtype, self.device))
                  for _ in range(self.num_layers)]
        if not kv_quant.is_quantized(dtype):
            return caches, None
        scale_shape = value_shape[:-1]  # [num_blocks, kv_heads, block_size]
        scales = [tuple(_zeros(scale_shape, kv_quant.SCALE_DTYPE, self.device) for _ in range(2))
                  for _ in range(self.num_layers)]
        return caches, scales

    def _num_blocks(self, memory_bytes: Optional[int]) -> int:
        if memory_bytes is None:
            memory_bytes = self._default_kv_bytes()
        num_blocks = memory_bytes // self.bytes_per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_bytes={memory_bytes} is smaller than one KV block "
                             f"({self.bytes_per_block} bytes)")
        return int(num_blocks)

    def _default_kv_bytes(self) -> int:
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * CUDA_DEFAULT_KV_SHARE)
        return min(int(_available_ram() * CPU_DEFAULT_KV_SHARE), CPU_DEFAULT_KV_CAP)

    # -- one step ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in out.finished_request_ids:
            self._generators.pop(request_id, None)
        if out.is_empty:
            return ModelRunnerOutput()
        # Single-token items first: they form the batched decode group at the front of the token batch.
        items = sorted(out.scheduled, key=_row_order(out.lora_slots))
        input_ids, positions, meta, sample_rows = self._prepare_inputs(items)
        lora_mapping = self._lora_mapping(items, out.lora_slots) if out.lora_slots else None
        with set_forward_context(meta, lora_mapping):
            hidden = self.model(input_ids, positions)
        if not sample_rows:
            return ModelRunnerOutput()
        sampling_items = [items[i] for i, _ in sample_rows]
        logits = self.model.compute_logits(hidden[torch.tensor([row for _, row in sample_rows], device=self.device)])
        if out.grammar_bitmask is not None:
            apply_grammar_bitmask(logits, [item.request.request_id for item in sampling_items], out.grammar_bitmask)
        sampler_out = self.sampler(logits, self._sampling_metadata(sampling_items))
        return self._make_output(sampling_items, sampler_out)

    def _prepare_inputs(self, items: list[ScheduledRequest]):
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[tuple[int, int]] = []  # (item index, row of its last token in the batch)
        prefills: list[PrefillSeq] = []
        num_decodes = sum(1 for s in items if s.num_tokens == 1)
        for index, item in enumerate(items):
            start = item.request.num_computed_tokens
            end = start + item.num_tokens
            row = len(token_ids)
            token_ids.extend(item.request.all_token_ids[start:end])
            positions.extend(range(start, end))
            blocks = item.block_ids
            slots.extend(blocks[p // block_size] * block_size + p % block_size for p in range(start, end))
            if index >= num_decodes:
                table = None if start == 0 else torch.tensor(blocks[:-(-end // block_size)], device=self.device)
                prefills.append(PrefillSeq(row, item.num_tokens, end, table))
            if item.samples:
                sample_rows.append((index, row + item.num_tokens - 1))
        positions_tensor = self._tensor(positions)
        decode = self._decode_batch(items[:num_decodes]) if num_decodes else None
        per_token = decode if not prefills else self._per_token_batch(items, positions_tensor)
        meta = AttentionMetadata(slot_mapping=self._tensor(slots), num_kv_heads=self.num_kv_heads,
                                 block_size=block_size, prefills=prefills, decode=decode,
                                 per_token=per_token if self.device.type == "cpu" else None)
        return self._tensor(token_ids), positions_tensor, meta, sample_rows

    def _lora_mapping(self, items: list[ScheduledRequest], assignment: dict[int, int]) -> Optional[LoRAMapping]:
        """Fill the slots this step needs, then map its rows (ordered by _row_order) to slots."""
        self.lora_slots.activate(assignment, self.lora_manager.adapter)
        row_slots = []
        for item in items:
            row_slots += [assignment.get(item.request.lora_generation, -1)] * item.num_tokens
        return LoRAMapping(row_slots) if max(row_slots) >= 0 else None

    def _per_token_batch(self, items: list[ScheduledRequest], positions: torch.Tensor) -> DecodeBatch:
        """Each token attends its sequence's cache up to its own position (AttentionMetadata.per_token)."""
        context_ends = [s.request.num_computed_tokens + s.num_tokens for s in items]
        max_blocks = -(-max(context_ends) // self.block_size)
        tables = torch.zeros(len(positions), max_blocks, dtype=torch.int64)
        row = 0
        for item, end in zip(items, context_ends):
            blocks = item.block_ids[:-(-end // self.block_size)]
            tables[row:row + item.num_tokens, :len(blocks)] = torch.tensor(blocks, dtype=torch.int64)
            row += item.num_tokens
        return DecodeBatch(tables, positions + 1, self.num_kv_heads, self.block_size)

    def _decode_batch(self, items: list[ScheduledRequest]) -> DecodeBatch:
        context_lens = [s.request.num_computed_tokens + 1 for s in items]
        max_blocks = -(-max(context_lens) // self.block_size)
        tables = [s.block_ids[:max_blocks] + [0] * (max_blocks - min(len(s.block_ids), max_blocks)) for s in items]
        return DecodeBatch(self._tensor(tables), self._tensor(context_lens), self.num_kv_heads, self.block_size)

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    # -- sampling ----------------------------------------------------------------------------------------

    def _generator(self, item: ScheduledRequest) -> Optional[torch.Generator]:
        request = item.request
        seed = request.sampling_params.seed
        if seed is None:
            return None
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
            self._generators[request.request_id] = generator
        return generator

    def _sampling_metadata(self, items: list[ScheduledRequest]) -> SamplingMetadata:
        requests = [s.request for s in items]
        params = [r.sampling_params for r in requests]
        needs_history = any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
                            for p in params)
        return SamplingMetadata.build(
            params=params,
            prompt_token_ids=[r.prompt_token_ids if needs_history else [] for r in requests],
            output_token_ids=[r.output_token_ids if needs_history else [] for r in requests],
            generators=[self._generator(s) for s in items],
            stop_token_ids_for_min_tokens=[
                set(r.stop_token_ids) if r.num_output_tokens < r.sampling_params.min_tokens else set()
                for r in requests],
            device=self.device,
        )

    def _make_output(self, items: list[ScheduledRequest], sampler_out) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        sampled = sampler_out.sampled_token_ids.tolist()
        for item, token_id in zip(items, sampled):
            result.sampled_token_ids[item.request.request_id] = token_id
        lp = sampler_out.logprobs
        if lp is not None:
            # A grammar's banned tokens have logprob -inf, which JSON cannot carry: clamped as vLLM does.
            values = lp.logprobs.clamp(min=LOGPROB_FLOOR).tolist()
            ids, ranks = lp.token_ids.tolist(), lp.ranks.tolist()
            for i, item in enumerate(items):
                n = item.request.sampling_params.logprobs
                if n is None:
                    continue
                entries = [(ids[i][0], values[i][0], ranks[i])]
                entries += [(ids[i][k], values[i][k], k) for k in range(1, n + 1)]
                result.logprobs[item.request.request_id] = entries
        return result


def _row_order(lora_slots: dict[int, int]):
    """Sort key of a step's items: decodes first (the batched decode group). With LoRA, each group is also
    ordered by adapter slot (base-model rows first), so that each slot's rows are one run of the batch (two
    when it has decodes and prefills) and its LoRA work a slice."""
    if not lora_slots:
        return lambda s: s.num_tokens != 1
    return lambda s: (s.num_tokens != 1, lora_slots.get(s.request.lora_generation, -1))


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor. On CPU it is fresh anonymous memory (huge pages asked for: cpu_allocator) whose
    pages are committed later, block by block (kv_commit.py): uncommitted, the block pool (which hands out its
    least recently used block first) would fault in page after page under load, until RSS had grown by the
    whole cache. Zeros matter: padded attention reads multiply stale slots by zero probability, and stale NaNs
    would poison that."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_zeros(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def _available_ram() -> int:
    available = mem_available()
    return available if available is not None else 8 << 30
