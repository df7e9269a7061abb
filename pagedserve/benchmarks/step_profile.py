"""`bench throughput --profile`: timers wrapped around the engine's parts for one run, and a torch.profiler
window over a few steady-state decode steps, to show where a step's time goes."""

from __future__ import annotations

import functools
import sys
import time
from collections import defaultdict
from typing import Any, Callable

import torch

from pagedserve.benchmarks.throughput import TORCH_PROFILE_TOP, PagedserveBackend, _sync


class _Patches:
    """Replace attributes with wrapped versions; restore() puts back exactly what was there."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def wrap(self, obj: Any, name: str, wrapper: Callable[[Callable], Callable]) -> None:
        had_own = name in vars(obj)  # False for a method that lives on the class
        original = getattr(obj, name)
        setattr(obj, name, wrapper(original))

        def undo() -> None:
            if had_own:
                setattr(obj, name, original)
            else:
                delattr(obj, name)  # back to the class's method

        self._undo.append(undo)

    def restore(self) -> None:
        while self._undo:
            self._undo.pop()()


class _Timers:
    """Accumulated seconds and calls per key. `bucket` can be switched to keep some steps apart."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.main: dict[str, float] = defaultdict(float)
        self.aside: dict[str, float] = defaultdict(float)
        self.bucket = self.main
        self.calls: dict[str, int] = defaultdict(int)

    def timed(self, key: str) -> Callable[[Callable], Callable]:
        def wrapper(fn: Callable) -> Callable:
            @functools.wraps(fn)
            def timed_call(*args, **kwargs):
                if self.cuda:
                    torch.cuda.synchronize(self.device)
                start = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    if self.cuda:
                        torch.cuda.synchronize(self.device)
                    self.bucket[key] += time.perf_counter() - start
                    if self.bucket is self.main:
                        self.calls[key] += 1
            return timed_call
        return wrapper


# Breakdown rows: (label, keys added, keys subtracted). Attention runs inside the model's forward.
PROFILE_ROWS = [
    ("model forward (excl. attention)", ("model_forward", "compute_logits"), ("attention",)),
    ("attention", ("attention",), ()),
    ("sampling", ("sampling_metadata", "sampler", "sampler_output"), ()),
    ("scheduling", ("schedule", "update_from_output", "finish_requests"), ()),
    ("input preparation", ("prepare_inputs",), ()),
    ("output processing", ("output_processor",), ()),
    ("request submission", ("add_request",), ()),
]
PROFILE_OTHER = "other Python overhead"


def _steady_state(scheduler) -> bool:
    """Nothing waits and every running request is past its prompt: a pure decode step comes next."""
    if scheduler.num_waiting:
        return False
    try:
        return all(r.num_computed_tokens >= r.num_prompt_tokens for r in scheduler.running)
    except AttributeError:
        return True


def profile_run(backend: PagedserveBackend, prompts: list[list[int]], output_len: int,
                torch_steps: int) -> dict:
    """Run the workload once with the engine's parts timed; return the breakdown (and torch.profiler ops)."""
    import pagedserve.attention.torch_paged as torch_paged

    llm = backend.llm
    engine = llm.engine
    runner = engine.runner
    timers = _Timers(backend.device)
    patches = _Patches()
    window = {"prof": None, "done": torch_steps <= 0, "steps": 0, "wall": 0.0, "step_wall": 0.0, "main_steps": 0,
              "index": 0}

    def step_wrapper(step: Callable) -> Callable:
        @functools.wraps(step)
        def profiled_step(*args, **kwargs):
            # Window steps are timed from entry to exit, profiler start/stop included, and kept out of the table.
            start = time.perf_counter()
            if (window["prof"] is None and not window["done"] and window["index"] >= 1
                    and _steady_state(engine.scheduler)):
                activities = [torch.profiler.ProfilerActivity.CPU]
                if backend.device.type == "cuda":
                    activities.append(torch.profiler.ProfilerActivity.CUDA)
                window["prof"] = torch.profiler.profile(activities=activities)
                window["prof"].start()
                timers.bucket = timers.aside
            in_window = window["prof"] is not None and not window["done"]
            step_start = time.perf_counter()
            try:
                return step(*args, **kwargs)
            finally:
                window["index"] += 1
                if in_window:
                    window["step_wall"] += time.perf_counter() - step_start
                    window["steps"] += 1
                    if window["steps"] >= torch_steps:
                        _sync(backend.device)
                        window["prof"].stop()
                        window["done"] = True
                        timers.bucket = timers.main
                    window["wall"] += time.perf_counter() - start
                else:
                    window["main_steps"] += 1
        return profiled_step

    # Attention: every model module that imported paged_attention calls it through its module global.
    attention_modules = [m for name, m in list(sys.modules.items())
                         if name.startswith("pagedserve.models.") and m is not None
                         and getattr(m, "paged_attention", None) is torch_paged.paged_attention]
    for module in attention_modules:
        patches.wrap(module, "paged_attention", timers.timed("attention"))
    patches.wrap(runner.model, "forward", timers.timed("model_forward"))
    patches.wrap(runner.model, "compute_logits", timers.timed("compute_logits"))
    patches.wrap(runner, "_prepare_inputs", timers.timed("prepare_inputs"))
    patches.wrap(runner, "_sampling_metadata", timers.timed("sampling_metadata"))
    patches.wrap(runner, "sampler", timers.timed("sampler"))
    patches.wrap(runner, "_make_output", timers.timed("sampler_output"))
    patches.wrap(engine.scheduler, "schedule", timers.timed("schedule"))
    patches.wrap(engine.scheduler, "update_from_output", timers.timed("update_from_output"))
    patches.wrap(engine.scheduler, "finish_requests", timers.timed("finish_requests"))
    patches.wrap(engine.output_processor, "process", timers.timed("output_processor"))
    patches.wrap(engine, "add_request", timers.timed("add_request"))
    patches.wrap(engine, "step", step_wrapper)
    try:
        run = backend.generate(prompts, output_len)
    finally:
        patches.restore()
        if window["prof"] is not None and not window["done"]:
            window["prof"].stop()
            timers.bucket = timers.main

    wall = run.elapsed_s - window["wall"]
    acc = timers.main
    rows: dict[str, dict[str, float]] = {}
    for label, plus, minus in PROFILE_ROWS:
        seconds = sum(acc.get(k, 0.0) for k in plus) - sum(acc.get(k, 0.0) for k in minus)
        rows[label] = {"seconds": seconds, "percent": 100.0 * seconds / wall if wall > 0 else 0.0}
    other = wall - sum(r["seconds"] for r in rows.values())
    rows[PROFILE_OTHER] = {"seconds": other, "percent": 100.0 * other / wall if wall > 0 else 0.0}
    result = {
        "wall_s": wall,
        "run_elapsed_s": run.elapsed_s,
        "steps": window["main_steps"],
        "output_tok_s": sum(len(t) for t in run.token_ids) / run.elapsed_s if run.elapsed_s > 0 else 0.0,
        "rows": rows,
        "details": {k: {"seconds": acc[k], "calls": timers.calls[k]} for k in sorted(acc)},
        "torch_profiler": None,
    }
    if window["prof"] is not None and window["steps"]:
        result["torch_profiler"] = _torch_top_ops(window["prof"], window["steps"], window["step_wall"],
                                                  backend.device.type == "cuda")
    return result


def _torch_top_ops(prof, steps: int, wall: float, cuda: bool) -> dict:
    events = list(prof.key_averages())
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    events.sort(key=lambda e: getattr(e, key, 0.0) or 0.0, reverse=True)
    ops = []
    for e in events[:TORCH_PROFILE_TOP]:
        op = {"name": e.key, "calls": int(e.count), "self_cpu_s": e.self_cpu_time_total / 1e6,
              "cpu_total_s": e.cpu_time_total / 1e6}
        if cuda:
            op["self_device_s"] = (getattr(e, "self_device_time_total", 0.0) or 0.0) / 1e6
        op["percent_of_window"] = 100.0 * op["self_device_s" if cuda else "self_cpu_s"] / wall if wall > 0 else 0.0
        ops.append(op)
    return {"steps": steps, "wall_s": wall, "sort_by": key, "top_ops": ops}
