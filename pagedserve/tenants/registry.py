"""Which tenant a bearer token belongs to: an immutable `TenantRegistry`, and the `TenantStore` that holds the one
in force and swaps it whole when the keys file is reloaded (SIGHUP), keeping the old one if the new file is bad.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from typing import Callable, Iterable, Optional

from pagedserve.tenants.keys_file import load_tenants
from pagedserve.tenants.tenant import ADMIN, Tenant, hash_key

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
"""The tenant name of `--api-key` keys, and of every request when the server runs without keys."""


def cli_key_tenant(key: str) -> Tenant:
    """An `--api-key` key: admin scope, tenant "default"; its prefix-cache salt comes from the key itself, so two
    such keys never share cached blocks (as before keys files existed)."""
    salt = hashlib.sha256(b"pagedserve-tenant:" + key.encode()).hexdigest()
    return Tenant(DEFAULT_TENANT, hash_key(key), ADMIN, cache_salt=salt)


ANONYMOUS = Tenant(DEFAULT_TENANT, None, ADMIN)
"""Who every request is when the server has no keys: everything is allowed, as it always was."""


class TenantRegistry:
    """The tenants and their key hashes. Never changed after it is built: a reload builds a new one."""

    def __init__(self, tenants: Iterable[Tenant], auth_required: bool) -> None:
        self.tenants: tuple[Tenant, ...] = tuple(tenants)
        self.auth_required = auth_required
        self._digests = tuple((bytes.fromhex(t.key_sha256), t) for t in self.tenants if t.key_sha256)

    def authenticate(self, token: bytes) -> Optional[Tenant]:
        """The tenant whose key is `token`, or None. The token's SHA-256 is compared with every tenant's in
        constant time (no early exit), so the time taken tells nothing about which keys exist."""
        digest = hashlib.sha256(token).digest()
        found = None
        for key_digest, tenant in self._digests:
            if hmac.compare_digest(digest, key_digest):
                found = tenant
        return found

    def names(self) -> list[str]:
        return sorted({t.name for t in self.tenants})


def build_registry(api_keys: Iterable[str], keys_file: Optional[str]) -> TenantRegistry:
    """The `--api-key` keys (admin, tenant "default") plus the keys file's tenants. Authentication is required as
    soon as either is given, even when the file has no tenants yet. ValueError on a bad file or a shared key."""
    tenants = [cli_key_tenant(key) for key in dict.fromkeys(api_keys)]
    if keys_file is not None:
        named = load_tenants(keys_file)
        cli_hashes = {t.key_sha256 for t in tenants}
        for tenant in named:
            if tenant.key_sha256 in cli_hashes:
                raise ValueError(f"{keys_file}: tenant {tenant.name!r} has the key of an --api-key key")
        tenants += named
    return TenantRegistry(tenants, auth_required=bool(tenants) or keys_file is not None)


class TenantStore:
    """The registry in force. `reload()` re-reads the keys file and swaps in a new registry with one assignment
    (requests already admitted keep the tenant they were admitted as); a bad file leaves the old one in force.
    `on_load` sees every registry that comes into force (start and reloads)."""

    def __init__(self, api_keys: Iterable[str], keys_file: Optional[str],
                 on_load: Optional[Callable[[TenantRegistry], None]] = None) -> None:
        self.api_keys, self.keys_file, self._on_load = list(api_keys), keys_file, on_load
        self.registry = self._build()  # a bad file at start: ValueError, the server does not start

    def _build(self) -> TenantRegistry:
        registry = build_registry(self.api_keys, self.keys_file)
        if self._on_load is not None:
            self._on_load(registry)
        return registry

    def reload(self) -> bool:
        """Re-read the keys file; True when the new one is in force, False (error logged) when it was refused."""
        if self.keys_file is None:
            logger.warning("reload asked, but the server has no --api-keys-file: nothing to reload")
            return False
        try:
            registry = self._build()
        except ValueError as e:
            logger.error("keys file not reloaded, the previous keys stay in force: %s", e)
            return False
        self.registry = registry
        logger.info("keys file %s reloaded: %d tenant(s): %s", self.keys_file, len(registry.names()),
                    ", ".join(registry.names()))
        return True
