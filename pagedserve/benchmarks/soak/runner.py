"""The soak's phases: warm-up (which measures capacity), the greedy probes' references, the load at a multiple of
capacity, the drain, and the resource comparison."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Optional

from pagedserve.benchmarks.soak import server_probe
from pagedserve.benchmarks.soak.checks import Reference, judge, reference_of
from pagedserve.benchmarks.soak.client import send
from pagedserve.benchmarks.soak.mix import MixConfig, RequestMix
from pagedserve.benchmarks.soak.server_probe import ProcessStats
from pagedserve.benchmarks.soak.tally import Tally


@dataclass(frozen=True)
class SoakConfig:
    base_url: str
    model: str
    headers: dict
    duration: float = 60.0
    warmup: float = 10.0
    warmup_concurrency: int = 32
    request_rate: Optional[float] = None
    """Requests per second of the load; None: `overload` x the capacity measured in the warm-up."""
    overload: float = 2.0
    request_timeout: float = 300.0
    drain_timeout: float = 1.0
    resource_tolerance: float = 0.05
    server_pid: Optional[int] = None
    progress_interval: float = 10.0
    mix: MixConfig = MixConfig()


def _session():
    import aiohttp

    # A new connection per request: a reused keep-alive connection that the server closes at the same moment
    # would fail through no fault of either side, and be miscounted as a transport violation.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


class SoakRunner:
    def __init__(self, config: SoakConfig, log=print) -> None:
        self.config, self.log = config, log
        self.mix = RequestMix(config.mix, config.model)
        self.tally = Tally()
        self.warmup_tally = Tally()
        self.references: dict[int, Reference] = {}
        self.summary: dict = {}
        self._samples: list[dict] = []

    async def run(self) -> dict:
        c = self.config
        capacity = await self._warm_up()
        await self._drain("warm-up", checked=False)
        baseline = self._process_stats()
        await self._take_references()
        rate = c.request_rate if c.request_rate is not None else c.overload * capacity
        self.log(f"load: {rate:.2f} requests/s for {c.duration:g} s (capacity {capacity:.2f}/s)")
        started = time.monotonic()
        await self._load(rate)
        load_seconds = time.monotonic() - started
        drain_seconds = await self._drain("load", checked=True)
        end = self._process_stats()
        self._compare(baseline, end)
        self.summary.update(capacity_rps=round(capacity, 3), request_rate=round(rate, 3),
                            load_seconds=round(load_seconds, 1), drain_seconds=drain_seconds,
                            resources=self._resources(baseline, end))
        return self.summary

    # -- phases ------------------------------------------------------------------------------------------------

    async def _warm_up(self) -> float:
        """Closed loop at `warmup_concurrency` with the whole mix; returns completed requests per second."""
        c = self.config
        deadline = time.monotonic() + c.warmup
        async with _session() as session:
            async def worker() -> None:
                while time.monotonic() < deadline:
                    await self._one(session, self.mix.next(), self.warmup_tally)

            started = time.monotonic()
            await asyncio.gather(*(worker() for _ in range(c.warmup_concurrency)))
            elapsed = time.monotonic() - started
        for sample in self.warmup_tally.samples:
            self.tally.violation(f"warm-up: {sample}")
        self.tally.violations += self.warmup_tally.violations - len(self.warmup_tally.samples)
        completed = self.warmup_tally.outcomes["complete"]
        self.log(f"warm-up: {completed} requests completed in {elapsed:.1f} s "
                 f"({dict(self.warmup_tally.outcomes)})")
        if completed == 0:
            raise ValueError("no request completed during the warm-up: is the server serving?")
        return completed / elapsed

    async def _take_references(self) -> None:
        async with _session() as session:
            for index in range(len(self.mix.probes)):
                request = self.mix.probe_alone(index)
                reply = await send(session, self.config.base_url, request, self.config.headers,
                                   self.config.request_timeout)
                self.references[index] = reference_of(request, reply)

    async def _load(self, rate: float) -> None:
        c = self.config
        gaps = random.Random(c.mix.seed + 1)
        tasks: set[asyncio.Task] = set()
        async with _session() as session:
            monitor = asyncio.ensure_future(self._monitor(session))
            start = next_send = time.monotonic()
            while next_send < start + c.duration:
                await asyncio.sleep(max(0.0, next_send - time.monotonic()))
                task = asyncio.ensure_future(self._one(session, self.mix.next(), self.tally))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                next_send += gaps.expovariate(rate)
            if tasks:
                await asyncio.wait(set(tasks))
            monitor.cancel()
            await asyncio.gather(monitor, return_exceptions=True)

    async def _one(self, session, request, tally: Tally) -> None:
        reply = await send(session, self.config.base_url, request, self.config.headers, self.config.request_timeout)
        tally.add(request, reply, judge(request, reply, self.references))

    async def _monitor(self, session) -> None:
        """Every second: /health must be 200; the gauges and process stats are sampled; a progress line now and
        then."""
        c, last_log = self.config, time.monotonic()
        while True:
            await asyncio.sleep(1.0)
            try:
                status = await server_probe.health_status(session, c.base_url)
                gauges = await server_probe.read_gauges(session, c.base_url, c.headers)
            except Exception as e:  # noqa: BLE001 - any failure to answer is the server's
                status, gauges = None, None
                self.tally.violation(f"/health or /metrics did not answer: {type(e).__name__}: {e}")
            if status != 200 and status is not None:
                self.tally.violation(f"/health answered {status} during the load")
            stats = self._process_stats()
            self._samples.append({"gauges": gauges, "stats": stats})
            if time.monotonic() - last_log >= c.progress_interval:
                last_log = time.monotonic()
                self._progress(gauges, stats)

    def _progress(self, gauges: Optional[dict], stats: Optional[ProcessStats]) -> None:
        t = self.tally
        line = f"  {t.requests} done: {dict(t.outcomes)}"
        if gauges:
            line += f"; running {gauges['num_requests_running']:g}, waiting {gauges['num_requests_waiting']:g}"
        if stats:
            line += f"; RSS {stats.rss_bytes / 2 ** 20:.0f} MiB, {stats.threads} threads, {stats.open_fds} fds"
        self.log(line)

    async def _drain(self, phase: str, checked: bool) -> Optional[float]:
        """Seconds until running, waiting and KV usage are all 0 (polled every 20 ms, for up to 30 s); a
        violation when `checked` and it takes longer than drain_timeout."""
        c = self.config
        started = time.monotonic()
        async with _session() as session:
            while True:
                gauges = await server_probe.read_gauges(session, c.base_url, c.headers)
                elapsed = time.monotonic() - started
                if gauges is not None and not any(gauges.values()):
                    break
                if elapsed > 30:
                    self.tally.violation(f"after the {phase}, the server did not drain in 30 s: {gauges}")
                    return None
                await asyncio.sleep(0.02)
        if checked and elapsed > c.drain_timeout:
            self.tally.violation(f"after the {phase}, running/waiting/KV usage took {elapsed:.2f} s to reach 0 "
                                 f"(limit {c.drain_timeout:g} s)")
        await asyncio.sleep(0.5)  # let the server finish closing the connections of the phase
        return round(elapsed, 3)

    # -- resources ---------------------------------------------------------------------------------------------

    def _process_stats(self) -> Optional[ProcessStats]:
        return ProcessStats.read(self.config.server_pid) if self.config.server_pid is not None else None

    def _compare(self, baseline: Optional[ProcessStats], end: Optional[ProcessStats]) -> None:
        if baseline is None or end is None:
            return
        limit = 1 + self.config.resource_tolerance
        for name in ("rss_bytes", "threads", "open_fds", "processes"):
            before, after = getattr(baseline, name), getattr(end, name)
            if after > before * limit:
                self.tally.violation(f"{name} grew from {before} after the warm-up to {after} after the load "
                                     f"(limit +{self.config.resource_tolerance:.0%})")

    def _resources(self, baseline: Optional[ProcessStats], end: Optional[ProcessStats]) -> Optional[dict]:
        if baseline is None or end is None:
            return None
        peak = max((s["stats"].rss_bytes for s in self._samples if s["stats"] is not None), default=0)
        return {"after_warmup": baseline.as_dict(), "after_load": end.as_dict(),
                "peak_rss_mib_during_load": round(peak / 2 ** 20, 1)}
