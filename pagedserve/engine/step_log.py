"""Per-step timings of an engine core, for measuring where a run's time goes (benchmarks/step_log.py reads them).

With PAGEDSERVE_STEP_LOG=<path prefix> set, every EngineCore (the offline `LLM`'s, or the server's engine-core
process) writes `<prefix>-<pid>.tsv`: a header line, then one line per step with its start and end
(time.perf_counter() seconds, one clock per machine), the tokens it computed, the requests it ran and how many
of those tokens were prefill (prompt chunks, or a preempted request's recomputation). Comparing the same
workload offline and through the server this way separates a slower step from time between steps.
"""

from __future__ import annotations

import os
from typing import Optional

from pagedserve.core.scheduler_output import SchedulerOutput

STEP_LOG_ENV = "PAGEDSERVE_STEP_LOG"
HEADER = "start\tend\ttokens\trequests\tprefill_tokens\n"


class StepLog:
    def __init__(self, path: str) -> None:
        try:
            self._file = open(path, "w", buffering=1)  # noqa: SIM115 - open for the engine's life, closed in close()
        except OSError as e:
            raise ValueError(f"{STEP_LOG_ENV}: cannot write the step log {path}: {e.strerror}") from e
        self._file.write(HEADER)

    @classmethod
    def from_env(cls) -> Optional["StepLog"]:
        """A log at `$PAGEDSERVE_STEP_LOG-<pid>.tsv` when the variable is set, else None."""
        prefix = os.environ.get(STEP_LOG_ENV)
        return cls(f"{prefix}-{os.getpid()}.tsv") if prefix else None

    @staticmethod
    def prefill_tokens(scheduler_output: SchedulerOutput) -> int:
        """Tokens of the step that are not single-token decodes; read before the step updates the requests."""
        return sum(item.num_tokens for item in scheduler_output.scheduled
                   if item.num_tokens > 1 or item.request.num_computed_tokens < item.request.num_prompt_tokens)

    def record(self, start: float, end: float, scheduler_output: SchedulerOutput, prefill_tokens: int) -> None:
        tokens = sum(item.num_tokens for item in scheduler_output.scheduled)
        self._file.write(f"{start:.6f}\t{end:.6f}\t{tokens}\t{len(scheduler_output.scheduled)}\t{prefill_tokens}\n")

    def close(self) -> None:
        self._file.close()
