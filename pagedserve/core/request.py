"""A request as the core sees it: token ids, how many are computed, status. Plain data."""

from __future__ import annotations

import enum
import time
from typing import Optional

from pagedserve.lora.request import LoRARequest
from pagedserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> Optional[str]:
        """The OpenAI finish_reason of a finished status."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class RequestIdInUseError(ValueError):
    """A request id that a request still in the engine has (the server maps it to a 400 on X-Request-Id)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in use")
        self.request_id = request_id

    def __reduce__(self):  # it travels back from the engine-core process pickled
        return (type(self), (self.request_id,))


class Request:
    """One sequence to generate. A request with n > 1 reaches the core as n of these.

    The scheduler only looks at ``num_tokens`` (prompt + output so far) and ``num_computed_tokens`` (whose
    KV is in the cache): prefill, chunked prefill, decode and recompute after preemption are all "compute
    the tokens from num_computed_tokens up to num_tokens".
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        arrival_time: Optional[float] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
        tenant: Optional[str] = None,
        lora_request: Optional[LoRARequest] = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = sampling_params.max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.stop_reason: Optional[int | str] = None
        self.num_preemptions = 0
        self.cache_salt = cache_salt
        self.priority = priority
        """Lower runs first (vLLM's convention); only the priority and fair policies look at it."""
        self.tenant = tenant
        """Who sent it (a tenant name or None): the fair policy shares computed tokens between tenants."""
        self.lora_request = lora_request
        """The LoRA adapter to run with (None: the base model)."""
        self.lora_generation: Optional[int] = None
        """The load of that adapter the core bound this request to on admission (LoRAAdapter.generation):
        slots and prefix-cache hashes refer to it, so a reloaded adapter never serves this request's KV."""
        self.structured_output = None
        """The core's state of the request's constraint (structured_output.manager.StructuredOutputRequest),
        set on admission when its params have structured_outputs; None otherwise."""
        self.num_cached_tokens = 0
        """Prompt tokens found in the prefix cache when the request was first scheduled."""
        self.first_scheduled_time: Optional[float] = None
        """When the scheduler first moved it from waiting to running (for queue-time metrics)."""
        # Stop checks need these token sets often; build them once.
        stop_ids = set(sampling_params.stop_token_ids)
        if not sampling_params.ignore_eos:
            stop_ids |= eos_token_ids
        self.stop_token_ids = frozenset(stop_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids):]

    @property
    def grammar_ready(self) -> bool:
        """False while the request's constraint is still compiling (it cannot be scheduled yet)."""
        return self.structured_output is None or self.structured_output.ready

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")
