"""AsyncLLM: the engine-core process, per-request queues, early-exit aborts, queue limit, shutdown, stats."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from conftest import assert_no_leaked_blocks

ENGINE = dict(dtype="float32", kv_cache_memory_bytes=1 << 22, max_model_len=256)
PROMPTS = ["The quick brown fox", "Paged attention stores", "Hello, world.", "Continuous batching re-forms",
           "12345", "Bonjour le monde", "emoji", "The lazy dog"]


def wait_idle(async_llm: AsyncLLM, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while async_llm.has_unfinished_requests() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert_no_leaked_blocks(async_llm)


@pytest.fixture(scope="module")
def async_llm(tiny_llama_dir):
    engine = AsyncLLM.from_kwargs(model=tiny_llama_dir, **ENGINE)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama_dir):
    return LLM(tiny_llama_dir, **ENGINE)


async def collect(async_llm, prompt, params, request_id=None):
    text, token_ids, outputs = "", [], []
    async for out in async_llm.generate(prompt, params, request_id):
        outputs.append(out)
        text += out.outputs[0].text
        token_ids += out.outputs[0].token_ids
    return text, token_ids, outputs


def test_concurrent_requests_match_offline_greedy(async_llm, offline):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        return await asyncio.gather(*(collect(async_llm, p, params) for p in PROMPTS))

    results = asyncio.run(main())
    for (text, token_ids, outputs), want in zip(results, expected):
        assert token_ids == want.outputs[0].token_ids
        assert text == want.outputs[0].text
        assert outputs[-1].finished and not any(o.finished for o in outputs[:-1])
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert len(outputs) > 1  # streamed as deltas, not one final output


def test_n_children_come_back_in_one_stream(async_llm):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True)
    _, _, outputs = asyncio.run(collect(async_llm, "Hello", params))
    per_child = {i: [] for i in range(3)}
    for out in outputs:
        for c in out.outputs:
            per_child[c.index] += c.token_ids
    assert all(len(ids) == 5 for ids in per_child.values())


def test_breaking_out_early_aborts_and_frees_blocks(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = async_llm.generate("The quick brown fox", params)
        async for out in gen:
            assert not out.finished
            break
        await gen.aclose()

    asyncio.run(main())
    wait_idle(async_llm, timeout=1.0)


def test_cancelled_consumer_aborts(async_llm):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        started = asyncio.Event()

        async def consume():
            async for _ in async_llm.generate("Hello", params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_idle(async_llm, timeout=1.0)


def test_rejected_request_raises_value_error(async_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        asyncio.run(collect(async_llm, list(range(5, 305)), SamplingParams(max_tokens=1)))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    wait_idle(async_llm)


def test_stats_snapshot_and_stat_loggers(async_llm):
    seen = []
    async_llm.stat_loggers.append(lambda stats, it: seen.append((stats, it)))
    try:
        asyncio.run(collect(async_llm, "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
    finally:
        async_llm.stat_loggers.pop()
    assert sum(it.num_generation_tokens for _, it in seen) == 4
    assert sum(it.num_prompt_tokens for _, it in seen) > 0
    [finished] = [f for _, it in seen for f in it.finished]
    assert finished.finish_reason == "length" and finished.num_generation_tokens == 4
    assert finished.queue_time is not None and 0 <= finished.queue_time <= finished.e2e_latency
    assert len([t for _, it in seen for t in it.time_to_first_tokens]) == 1
    assert len([t for _, it in seen for t in it.inter_token_latencies]) == 3
    assert async_llm.stats.num_running == 0 and async_llm.stats.kv_cache_usage == 0.0


def test_idle_front_end_and_engine_core_process_sleep(async_llm):
    import psutil

    for process in (psutil.Process(), psutil.Process(async_llm._client.process.pid)):
        time.sleep(0.05)
        before = process.cpu_times()
        time.sleep(0.5)
        after = process.cpu_times()
        assert (after.user + after.system) - (before.user + before.system) < 0.1


def test_the_engine_core_commits_its_kv_cache_while_idle_and_serves_meanwhile(tiny_llama_dir, offline, async_llm):
    import psutil

    from pagedserve.engine.core_proc import KV_COMMIT_AT_START_BYTES

    cache_bytes = KV_COMMIT_AT_START_BYTES + (512 << 20)
    # the same engine with a 4 MiB cache: what the process holds besides the cache
    baseline = psutil.Process(async_llm._client.process.pid).memory_info().rss
    engine = AsyncLLM.from_kwargs(model=tiny_llama_dir, **{**ENGINE, "kv_cache_memory_bytes": cache_bytes})
    try:
        core = psutil.Process(engine._client.process.pid)
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        _, token_ids, _ = asyncio.run(collect(engine, PROMPTS[0], params))
        assert token_ids == offline.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
        wanted = baseline + cache_bytes - (128 << 20)
        deadline = time.monotonic() + 60
        while core.memory_info().rss < wanted and time.monotonic() < deadline:
            time.sleep(0.1)
        assert core.memory_info().rss >= wanted, (core.memory_info().rss, baseline)
        busy = []  # CPU seconds per 0.5 s: once all is committed, the idle core sleeps
        while time.monotonic() < deadline and not (busy and busy[-1] < 0.1):
            before = core.cpu_times()
            time.sleep(0.5)
            after = core.cpu_times()
            busy.append((after.user + after.system) - (before.user + before.system))
        assert busy[-1] < 0.1, busy
    finally:
        engine.shutdown()


def test_engine_core_runs_in_its_own_process(async_llm):
    import os

    assert async_llm._client.process.pid != os.getpid() and async_llm._client.process.is_alive()
    assert async_llm.core_stats().num_blocks > 0


def test_killed_engine_core_fails_in_flight_requests_and_refuses_new_ones(tiny_llama_dir):
    import os
    import signal

    async_llm = AsyncLLM.from_kwargs(model=tiny_llama_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=250, ignore_eos=True)

    async def main():
        gen = async_llm.generate("Hello", params)
        await gen.__anext__()
        os.kill(async_llm._client.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="died"):
            await asyncio.wait_for(collect_rest(gen), timeout=10)

    async def collect_rest(gen):
        async for _ in gen:
            pass

    try:
        asyncio.run(main())
        assert not async_llm.is_alive()
        assert not async_llm.output_processor.requests and not async_llm.has_unfinished_requests()
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(async_llm, "Hello", params))
    finally:
        async_llm.shutdown()


def test_engine_core_start_up_error_is_raised_with_its_reason(tiny_llama_dir):
    with pytest.raises(RuntimeError, match="needs more KV cache than there is"):
        AsyncLLM.from_kwargs(model=tiny_llama_dir, dtype="float32", kv_cache_memory_bytes=1 << 16, max_model_len=256)


def test_stop_strings_seen_by_the_front_end_finish_the_core_request(async_llm, offline):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = offline.generate("The quick brown fox", greedy, use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop])
    text, _, outputs = asyncio.run(collect(async_llm, "The quick brown fox", params))
    assert text == full[:full.index(stop)] and outputs[-1].outputs[0].finish_reason == "stop"
    wait_idle(async_llm)


def test_queue_limit_rejects_without_losing_admitted_requests(tiny_llama_dir):
    # The first request must still be running when the second and third arrive, on a slow or loaded machine
    # too: it is long (1,000 tokens, about a second on the tiny model).
    async_llm = AsyncLLM.from_kwargs(model=tiny_llama_dir, max_num_seqs=1, max_num_queued_requests=1,
                                     **{**ENGINE, "max_model_len": 1024, "kv_cache_memory_bytes": 1 << 24})
    long_params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main():
        first = async_llm.generate("Hello", long_params)
        await first.__anext__()  # running now (max_num_seqs=1)
        second = asyncio.create_task(collect(async_llm, "World", params))
        deadline = time.monotonic() + 60
        while async_llm.stats.num_waiting < 1:
            assert time.monotonic() < deadline and async_llm.stats.num_running == 1, "the second request never waited"
            await asyncio.sleep(0.005)
        with pytest.raises(QueueFullError):
            await collect(async_llm, "Third", params)
        rest = [out async for out in first]
        return rest, await asyncio.wait_for(second, 60)

    try:
        rest, (_, second_ids, _) = asyncio.run(main())
        assert rest[-1].finished and len(second_ids) == 30
        wait_idle(async_llm)
    finally:
        async_llm.shutdown()


def test_shutdown_ends_in_flight_requests_and_refuses_new_ones(tiny_llama_dir):
    async_llm = AsyncLLM.from_kwargs(model=tiny_llama_dir, **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        gen = async_llm.generate("Hello", params)
        await gen.__anext__()
        async_llm.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass

    asyncio.run(main())
    assert not async_llm.is_alive()
    assert_no_leaked_blocks(async_llm)
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(async_llm, "Hello", params))
