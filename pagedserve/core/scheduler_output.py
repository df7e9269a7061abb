"""What the scheduler decided for one step; all the model runner reads."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from pagedserve.core.request import Request

if TYPE_CHECKING:
    from pagedserve.structured_output.manager import GrammarBitmask


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int
    """Tokens to compute this step, from request.num_computed_tokens on."""
    block_ids: list[int]
    """The request's whole block table."""

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last token, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    """Requests that finished since the last step: the runner drops any state it keeps for them."""
    lora_slots: dict[int, int] = field(default_factory=dict)
    """LoRA load generation -> slot, for the adapters of this step's requests (empty without LoRA): the
    runner makes sure each slot holds its adapter, then applies it to those requests' rows."""

    grammar_bitmask: Optional["GrammarBitmask"] = None
    """The allowed next tokens of this step's constrained rows (structured output), filled in by the engine
    core after scheduling; None when no request sampling this step has a constraint."""

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
