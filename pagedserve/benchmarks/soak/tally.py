"""Counting the soak's outcomes and keeping the first violations to show."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from pagedserve.benchmarks.soak.checks import Verdict
from pagedserve.benchmarks.soak.client import Reply
from pagedserve.benchmarks.soak.mix import SoakRequest

MAX_SAMPLES = 20


@dataclass
class Tally:
    outcomes: Counter = field(default_factory=Counter)
    statuses: Counter = field(default_factory=Counter)
    by_tag: dict[str, Counter] = field(default_factory=dict)
    violations: int = 0
    samples: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    greedy_checked: int = 0

    def add(self, request: SoakRequest, reply: Reply, verdict: Verdict) -> None:
        self.outcomes[verdict.outcome] += 1
        self.statuses[str(reply.status) if reply.status is not None else "none"] += 1
        for tag in request.tags:
            self.by_tag.setdefault(tag, Counter())[verdict.outcome] += 1
        self.completion_tokens += verdict.completion_tokens
        if verdict.outcome == "complete" and request.probe is not None:
            self.greedy_checked += 1
        if verdict.outcome == "violation":
            self.violation(f"request {request.number} {request.endpoint} {'/'.join(request.tags) or 'valid'}: "
                           + "; ".join(verdict.problems))

    def violation(self, text: str) -> None:
        """A violation of the server's own (not of one request): a leak, a slow drain, a failed /health."""
        self.violations += 1
        if len(self.samples) < MAX_SAMPLES:
            self.samples.append(text)

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status.startswith("5"))
