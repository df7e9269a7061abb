"""Per-tenant rate limits: token buckets for requests and tokens per minute, and a count of concurrent requests.

A bucket of capacity C (the per-minute limit) starts full and refills at C/60 per second; a request takes 1 from
the requests bucket, and reserves its worst-case token cost (prompt + max_tokens * n) from the tokens bucket, the
unused part of which is given back when it ends. Time comes from an injectable clock (seconds, monotonic), so
tests move it by hand. Not thread-safe: the server uses a limiter from its event loop only.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

Clock = Callable[[], float]

REQUESTS, TOKENS, CONCURRENCY = "requests", "tokens", "concurrency"
LIMIT_FIELDS = ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests")


@dataclass(frozen=True)
class Limits:
    """A tenant's limits; None = unlimited."""

    requests_per_minute: Optional[int] = None
    tokens_per_minute: Optional[int] = None
    max_concurrent_requests: Optional[int] = None

    def as_dict(self) -> dict[str, Optional[int]]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Refusal:
    """Why a request may not run now: the `limit` it hit (REQUESTS, TOKENS or CONCURRENCY), the seconds until it
    could pass (`math.inf`: never, it costs more than the whole bucket), and the numbers for the message."""

    limit: str
    retry_after: float
    capacity: int
    requested: int

    @property
    def never(self) -> bool:
        return math.isinf(self.retry_after)


class TokenBucket:
    """`capacity` units, refilled continuously at `per_second`; starts full."""

    def __init__(self, capacity: float, per_second: float, clock: Clock) -> None:
        self.capacity, self.per_second, self._clock = capacity, per_second, clock
        self._level, self._stamp = float(capacity), clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._stamp) * self.per_second)
        self._stamp = now
        return self._level

    def seconds_until(self, amount: float) -> float:
        """Seconds until `amount` units are there (0: now; inf: never, it is over the capacity)."""
        if amount > self.capacity:
            return math.inf
        return max(0.0, (amount - self.level()) / self.per_second)

    def take(self, amount: float) -> float:
        """Take `amount` units and return 0, or take nothing and return the seconds to wait."""
        wait = self.seconds_until(amount)
        if wait == 0:
            self._level -= amount
        return wait

    def give_back(self, amount: float) -> None:
        self._level = min(self.capacity, self.level() + amount)

    def seconds_until_full(self) -> float:
        return (self.capacity - self.level()) / self.per_second

    def resize(self, capacity: float, per_second: float) -> None:
        """New limits (a reload): what was used stays used, within the new capacity."""
        used = self.capacity - self.level()
        self.capacity, self.per_second = capacity, per_second
        self._level = min(capacity, max(0.0, capacity - used))


def _per_minute_bucket(per_minute: Optional[int], clock: Clock,
                       old: Optional[TokenBucket]) -> Optional[TokenBucket]:
    if per_minute is None:
        return None
    if old is None:
        return TokenBucket(per_minute, per_minute / 60.0, clock)
    old.resize(per_minute, per_minute / 60.0)
    return old


class TenantLimiter:
    """One tenant's buckets and its count of requests in flight."""

    def __init__(self, limits: Limits, clock: Clock) -> None:
        self._clock = clock
        self.limits = Limits()
        self.requests: Optional[TokenBucket] = None
        self.tokens: Optional[TokenBucket] = None
        self.in_flight = 0
        self.configure(limits)

    def configure(self, limits: Limits) -> None:
        """Apply (new) limits, keeping the state of the buckets that stay."""
        if limits == self.limits:
            return
        self.requests = _per_minute_bucket(limits.requests_per_minute, self._clock, self.requests)
        self.tokens = _per_minute_bucket(limits.tokens_per_minute, self._clock, self.tokens)
        self.limits = limits

    def admit(self) -> Optional[Refusal]:
        """A new request: within the concurrency limit, it takes one from the requests bucket and counts as in
        flight until `release()`. Returns the Refusal instead when a limit says no (then nothing changed)."""
        most = self.limits.max_concurrent_requests
        if most is not None and self.in_flight >= most:
            return Refusal(CONCURRENCY, 1.0, most, self.in_flight + 1)
        if self.requests is not None:
            wait = self.requests.take(1)
            if wait:
                return Refusal(REQUESTS, wait, int(self.requests.capacity), 1)
        self.in_flight += 1
        return None

    def release(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)

    def reserve(self, tokens: int) -> Optional[Refusal]:
        """Take a request's worst-case token cost, or return the Refusal (nothing taken)."""
        if self.tokens is None:
            return None
        wait = self.tokens.take(tokens)
        return Refusal(TOKENS, wait, int(self.tokens.capacity), tokens) if wait else None

    def refund(self, tokens: int) -> None:
        """Give back the part of a reservation that was not used."""
        if self.tokens is not None and tokens > 0:
            self.tokens.give_back(tokens)


class RateLimiter:
    """The limiters of all tenants, by tenant name: a tenant's state survives a reload of the keys file (its
    limits are updated in place the next time it is looked up)."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self.clock = clock
        self._tenants: dict[str, TenantLimiter] = {}

    def for_tenant(self, name: str, limits: Limits) -> TenantLimiter:
        limiter = self._tenants.get(name)
        if limiter is None:
            limiter = self._tenants[name] = TenantLimiter(limits, self.clock)
        else:
            limiter.configure(limits)
        return limiter


def format_duration(seconds: float) -> str:
    """OpenAI's `x-ratelimit-reset-*` format (Go durations): "120ms", "1.5s", "6m0s", "1h2m3s"."""
    if seconds < 1:
        millis = math.ceil(seconds * 1000)
        return f"{millis}ms" if millis > 0 else "0s"
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    text = f"{secs:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{text}"
    return f"{int(minutes)}m{text}" if minutes >= 1 else text
