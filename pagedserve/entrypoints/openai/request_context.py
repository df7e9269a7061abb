"""What the gate (gate.py) learns about a request and hands to the routes: its id, its tenant, the tenant's
rate limiter with this request's share of it (a concurrency slot, a token reservation), and the record the
routes fill in for its access-log line."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Optional

from starlette.requests import Request as HTTPRequest

from pagedserve.entrypoints.openai.rate_limits import refusal_error
from pagedserve.logging_utils.request_log import RequestRecord
from pagedserve.metrics.prometheus import TenantMetrics
from pagedserve.tenants.rate_limiter import TenantLimiter
from pagedserve.tenants.registry import ANONYMOUS
from pagedserve.tenants.tenant import Tenant

SCOPE_KEY = "pagedserve.request"
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass
class RequestContext:
    """One HTTP request's id (the client's X-Request-Id or a new one; also the engine's request id), its tenant
    and, when the tenant is known, the tenant's limiter and metrics."""

    request_id: str
    tenant: Tenant
    limiter: Optional[TenantLimiter] = None
    metrics: Optional[TenantMetrics] = None
    holds_slot: bool = False
    reserved_tokens: int = 0
    replicas: list[str] = field(default_factory=list)
    """The engine replicas that served it (scale-out on Ray), in order; sent as x-pagedserve-replica."""
    record: RequestRecord = field(default_factory=RequestRecord)
    """What its access-log line will say (logging_utils/request_log.py)."""

    def admit(self):
        """Take a concurrency slot and a request from the tenant's buckets; the Refusal when a limit says no."""
        if self.limiter is None:
            return None
        refusal = self.limiter.admit()
        if refusal is None:
            self.holds_slot = True
        elif self.metrics is not None:
            self.metrics.count_rate_limited(self.tenant.name, refusal.limit)
        return refusal

    def reserve_tokens(self, cost: int) -> None:
        """Reserve a request's worst-case token cost before it reaches the engine; OpenAIError 429 if it may not."""
        if self.limiter is None:
            return
        refusal = self.limiter.reserve(cost)
        if refusal is not None:
            if self.metrics is not None:
                self.metrics.count_rate_limited(self.tenant.name, refusal.limit)
            raise refusal_error(refusal, self.tenant.name)
        self.reserved_tokens += cost

    def finish_tokens(self, prompt_tokens: int, generated_tokens: int) -> None:
        """The request's engine work is over: count its tokens and refund what it reserved beyond them."""
        if self.metrics is not None:
            self.metrics.count_tokens(self.tenant.name, prompt_tokens, generated_tokens)
        self._refund(prompt_tokens + generated_tokens)

    def close(self) -> None:
        """The response is sent (or the client is gone): refund any reservation left, give the slot back."""
        self._refund(0)
        if self.holds_slot and self.limiter is not None:
            self.limiter.release()
            self.holds_slot = False

    def _refund(self, used: int) -> None:
        if self.limiter is not None and self.reserved_tokens:
            self.limiter.refund(self.reserved_tokens - used)
        self.reserved_tokens = 0


def request_context(http: HTTPRequest) -> RequestContext:
    """The context the gate put on this request (an anonymous one when the app runs without the gate)."""
    ctx = http.scope.get(SCOPE_KEY)
    if ctx is None:
        ctx = http.scope[SCOPE_KEY] = RequestContext(new_request_id(), ANONYMOUS)
    return ctx
