"""The HTTP face of the tenants' rate limits: OpenAI's 429 bodies and its `x-ratelimit-*` headers."""

from __future__ import annotations

import math

from pagedserve.entrypoints.openai.errors import OpenAIError
from pagedserve.tenants.rate_limiter import CONCURRENCY, REQUESTS, TOKENS, Refusal, TenantLimiter, format_duration

RATE_LIMITED_ROUTES = ("/v1/completions", "/v1/chat/completions")
"""The routes whose requests count against a tenant's limits."""

_PER_MINUTE = {REQUESTS: "requests per min (RPM)", TOKENS: "tokens per min (TPM)"}


def refusal_error(refusal: Refusal, tenant: str) -> OpenAIError:
    """OpenAI's 429: code "rate_limit_exceeded", `type` the limit ("requests" or "tokens"), `Retry-After` in
    whole seconds. A request that costs more than the whole token bucket can never pass: the message says so and
    `x-should-retry: false` stops the openai client's automatic retries."""
    error_type = REQUESTS if refusal.limit == CONCURRENCY else refusal.limit
    if refusal.never:
        message = (f"Request too large for tenant {tenant} on {_PER_MINUTE[refusal.limit]}: Limit "
                   f"{refusal.capacity}, Requested {refusal.requested} (prompt tokens + max_tokens * n). It can "
                   "never pass: lower max_tokens, n or the prompt.")
        return OpenAIError(message, 429, code="rate_limit_exceeded", error_type=error_type,
                           headers={"x-should-retry": "false"})
    if refusal.limit == CONCURRENCY:
        message = (f"Too many concurrent requests for tenant {tenant}: Limit {refusal.capacity}. Please try again "
                   "when one of them has finished.")
    else:
        message = (f"Rate limit reached for tenant {tenant} on {_PER_MINUTE[refusal.limit]}: Limit "
                   f"{refusal.capacity}, Requested {refusal.requested}. Please try again in "
                   f"{format_duration(refusal.retry_after)}.")
    retry_after = str(max(1, math.ceil(refusal.retry_after - 1e-6)))  # 12.000000001 s is "12", not "13"
    return OpenAIError(message, 429, code="rate_limit_exceeded", error_type=error_type,
                       headers={"Retry-After": retry_after})


def ratelimit_headers(limiter: TenantLimiter) -> list[tuple[bytes, bytes]]:
    """OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` for the per-minute limits the tenant has:
    the bucket's capacity, what is left in it now, and the time until it is full again."""
    headers = []
    for kind, bucket in ((REQUESTS, limiter.requests), (TOKENS, limiter.tokens)):
        if bucket is None:
            continue
        remaining = math.floor(bucket.level() + 1e-9)  # a float rounding error below 5 still reads 5
        headers += [(f"x-ratelimit-limit-{kind}".encode(), str(int(bucket.capacity)).encode()),
                    (f"x-ratelimit-remaining-{kind}".encode(), str(remaining).encode()),
                    (f"x-ratelimit-reset-{kind}".encode(), format_duration(bucket.seconds_until_full()).encode())]
    return headers
