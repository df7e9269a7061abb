"""kv_commit: the CPU KV cache's pages committed block by block, the first blocks before the engine is ready and
the rest while it is idle; a cache used before it is all committed gives the same tokens."""

from __future__ import annotations

import ctypes
import errno
import functools
import os

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.engine import llm_engine
from pagedserve.engine.core import EngineCore
from pagedserve.executor.cpu_allocator import huge_page_zeros
from pagedserve.executor import kv_commit
from pagedserve.executor.kv_commit import KVCommitter

ROW = 2 << 20  # one transparent huge page per block and tensor: residency is exact whatever the page size


def _needs_populate_write() -> None:
    release = tuple(int(part) for part in os.uname().release.split("-")[0].split(".")[:2])
    if release < (5, 14):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux < 5.14): the cache stays lazy")


def _resident_rows(tensor: torch.Tensor, row_bytes: int) -> list[bool]:
    """Per row of `tensor`: whether all its pages are resident (mincore)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    size = tensor.numel() * tensor.element_size()
    pages = (ctypes.c_ubyte * (size // 4096))()
    assert libc.mincore(ctypes.c_void_p(tensor.data_ptr()), ctypes.c_size_t(size), pages) == 0
    per_row = row_bytes // 4096
    return [all(p & 1 for p in pages[r * per_row:(r + 1) * per_row]) for r in range(size // row_bytes)]


def test_committing_bytes_commits_whole_blocks_in_order_in_every_tensor():
    _needs_populate_write()
    blocks = 8
    tensors = [huge_page_zeros(blocks * ROW).view(blocks, ROW), huge_page_zeros(blocks * ROW).view(blocks, ROW)]
    committer = KVCommitter(tensors, blocks)
    assert committer.bytes_per_block == 2 * ROW and committer.committed_blocks == 0
    assert committer.commit_bytes(0) == 0
    assert committer.commit_bytes(3 * 2 * ROW - 1) == 3 * 2 * ROW and committer.committed_blocks == 3
    for tensor in tensors:
        assert _resident_rows(tensor, ROW) == [True] * 3 + [False] * 5
    assert committer.commit_bytes(1) == ROW  # one unit: the next block of the first tensor only
    assert committer.committed_blocks == 3
    assert _resident_rows(tensors[0], ROW) == [True] * 4 + [False] * 4
    assert _resident_rows(tensors[1], ROW) == [True] * 3 + [False] * 5
    assert committer.commit_bytes(1 << 40) == 9 * ROW and committer.done
    assert committer.committed_bytes == blocks * 2 * ROW and committer.commit_bytes(ROW) == 0
    for tensor in tensors:
        assert all(_resident_rows(tensor, ROW)) and not tensor.any()


def test_committing_keeps_what_a_block_already_holds():
    blocks = 4
    tensor = huge_page_zeros(blocks * ROW).view(blocks, ROW)
    tensor[2].fill_(7)  # written before the commit reached it: faulted in then
    KVCommitter([tensor], blocks).commit_all()
    assert bool((tensor[2] == 7).all()) and not tensor[[0, 1, 3]].any()


def test_a_committer_refuses_tensors_that_are_not_rows_of_blocks():
    with pytest.raises(ValueError, match="num_blocks rows"):
        KVCommitter([torch.zeros(4, 8), torch.zeros(5, 8)], 4)
    with pytest.raises(ValueError, match="num_blocks rows"):
        KVCommitter([torch.zeros(8, 4).t()], 4)


def test_an_engine_commits_what_it_is_told_at_start_and_the_rest_when_idle(tiny_llama_dir, monkeypatch):
    _needs_populate_write()
    monkeypatch.setattr(llm_engine, "EngineCore", functools.partial(EngineCore, kv_commit_at_start=1 << 20))
    llm = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    core = llm.engine.core
    committer = core.runner.kv_commit
    assert not committer.done and committer.committed_bytes <= 1 << 20
    passes = 0
    while core.commit_kv_memory(num_bytes=2 << 20):
        passes += 1
    assert committer.done and passes >= 3  # 7 MiB and more, 2 MiB a pass
    assert not core.commit_kv_memory()


def test_tokens_are_the_same_whether_the_cache_was_committed_first_or_faulted_in_as_used(tiny_llama_dir, monkeypatch):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5 + i, 17, 3 * i + 1, 40, 9] * (i + 2)} for i in range(12)]
    eager = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert eager.engine.core.runner.kv_commit.done
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    del eager
    monkeypatch.setattr(llm_engine, "EngineCore", functools.partial(EngineCore, kv_commit_at_start=0))
    lazy = LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    assert lazy.engine.core.runner.kv_commit.committed_blocks == 0
    assert [o.outputs[0].token_ids for o in lazy.generate(prompts, params, use_tqdm=False)] == expected
    while lazy.engine.core.commit_kv_memory():  # committing blocks that hold cached prefixes keeps them
        pass
    again = lazy.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == expected
    assert sum(o.num_cached_tokens for o in again) > 0


def test_a_cache_committed_later_that_cannot_fit_fails_at_start_naming_the_flag(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(llm_engine, "EngineCore", functools.partial(EngineCore, kv_commit_at_start=1 << 20))
    monkeypatch.setattr(kv_commit, "mem_available", lambda: 2 << 20)
    with pytest.raises(MemoryError, match="kv-cache-memory-bytes"):
        LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)
    monkeypatch.setattr(kv_commit, "mem_available", lambda: 64 << 20)
    LLM(tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=8 << 20)


def test_a_kernel_that_cannot_commit_ahead_leaves_the_cache_to_fault_in_after_one_try(monkeypatch):
    calls = []
    monkeypatch.setattr(kv_commit, "_madvise_populate", lambda address, length: calls.append(length) or errno.EINVAL)
    blocks = 8
    committer = KVCommitter([torch.zeros(blocks, 1024), torch.zeros(blocks, 1024)], blocks)
    assert committer.commit_bytes(1 << 30) == 0 and committer.done and len(calls) == 1
    assert committer.commit_bytes(1 << 30) == 0 and len(calls) == 1
