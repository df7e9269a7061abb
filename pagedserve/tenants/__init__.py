"""Tenants of the server: API keys with scopes, default priorities and rate limits.

Pure Python (no torch, no web framework), so that `pagedserve keys` starts fast:

- `tenant.py`: the `Tenant` record and the validation of its fields.
- `keys_file.py`: the keys file (TOML or JSON), read with line numbers in every error, and `add_tenant`.
- `registry.py`: `TenantRegistry` (immutable: authentication in constant time) and `TenantStore` (the registry in
  force, swapped whole on reload).
- `rate_limiter.py`: token buckets for requests and tokens per minute, and concurrent requests, per tenant.
"""

from pagedserve.tenants.rate_limiter import Limits, RateLimiter, Refusal, TenantLimiter, TokenBucket
from pagedserve.tenants.registry import TenantRegistry, TenantStore, build_registry
from pagedserve.tenants.tenant import ADMIN, SCOPES, USER, Tenant, hash_key, new_key

__all__ = ["ADMIN", "SCOPES", "USER", "Limits", "RateLimiter", "Refusal", "Tenant", "TenantLimiter",
           "TenantRegistry", "TenantStore", "TokenBucket", "build_registry", "hash_key", "new_key"]
