"""A tenant: who an API key belongs to, what it may do, its default priority and its rate limits.

Keys are never stored: a tenant holds the SHA-256 of its key (`hash_key`), as the keys file does.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pagedserve.tenants.rate_limiter import LIMIT_FIELDS, Limits

ADMIN, USER = "admin", "user"
SCOPES = (ADMIN, USER)
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,64}")
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")
RESERVED_NAMES = ("default", "other")
"""Not for keys-file tenants: "default" is the `--api-key` keys' tenant, "other" the metrics label of tenants
beyond --max-metric-tenants."""
FIELDS = ("key_sha256", "scope", "priority", "min_priority", *LIMIT_FIELDS)
"""Every field a tenant may have in the keys file; anything else is refused."""


def hash_key(key: str) -> str:
    """The SHA-256 of an API key, as 64 lowercase hex characters (what the keys file stores)."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    """A new random API key (256 bits from `secrets`)."""
    return "ps-" + secrets.token_urlsafe(32)


def name_salt(name: str) -> str:
    """The prefix-cache salt of a named tenant: every key of the tenant shares its cache, no other key does."""
    return hashlib.sha256(b"pagedserve-tenant-name:" + name.encode()).hexdigest()


class FieldError(ValueError):
    """A problem with one tenant's definition; `field` names the field at fault (None: the tenant as a whole),
    so that the keys file can point at its line."""

    def __init__(self, tenant: str, field_name: Optional[str], problem: str) -> None:
        super().__init__(f"tenant {tenant!r}: {problem}")
        self.tenant, self.field, self.problem = tenant, field_name, problem


@dataclass(frozen=True)
class Tenant:
    """One tenant. `priority` is the default priority of its requests (lower runs first); a user-scope tenant may
    ask for any priority >= `min_priority`, an admin for any. `cache_salt` keeps its prefix-cache blocks apart
    from every other tenant's (None: no isolation, the server runs without keys)."""

    name: str
    key_sha256: Optional[str] = None
    scope: str = USER
    priority: int = 0
    min_priority: int = 0
    limits: Limits = field(default_factory=Limits)
    cache_salt: Optional[str] = None

    @property
    def is_admin(self) -> bool:
        return self.scope == ADMIN

    @classmethod
    def from_fields(cls, name: Any, fields: Any) -> "Tenant":
        """A tenant from its keys-file table; FieldError names the field of any problem."""
        if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
            raise FieldError(str(name), None, "a tenant name is 1 to 64 of the characters A-Z a-z 0-9 . _ -")
        if name in RESERVED_NAMES:
            raise FieldError(name, None, f"the tenant names {' and '.join(map(repr, RESERVED_NAMES))} are reserved")
        if not isinstance(fields, Mapping):
            raise FieldError(name, None, f"must be a table of fields, got {type(fields).__name__}")
        for key in fields:
            if key not in FIELDS:
                raise FieldError(name, key, f"unknown field {key!r} (known: {', '.join(FIELDS)})")
        key_sha256 = _key_hash_field(name, fields)
        scope = fields.get("scope", USER)
        if scope not in SCOPES:
            raise FieldError(name, "scope", f"scope must be {ADMIN!r} or {USER!r}, got {scope!r}")
        priority = _int_field(name, fields, "priority", 0)
        min_priority = _int_field(name, fields, "min_priority", priority)
        if min_priority > priority:
            raise FieldError(name, "min_priority", f"min_priority ({min_priority}) must not be above priority "
                             f"({priority}): it is the best (lowest) priority the tenant may ask for")
        limits = Limits(**{k: _limit_field(name, fields, k) for k in LIMIT_FIELDS})
        return cls(name, key_sha256, scope, priority, min_priority, limits, name_salt(name))

    def to_fields(self) -> dict[str, Any]:
        """The keys-file table of this tenant (the inverse of from_fields; defaults left out)."""
        out: dict[str, Any] = {"key_sha256": self.key_sha256, "scope": self.scope, "priority": self.priority}
        if self.min_priority != self.priority:
            out["min_priority"] = self.min_priority
        out.update((k, v) for k, v in self.limits.as_dict().items() if v is not None)
        return out


def _key_hash_field(name: str, fields: Mapping) -> str:
    if "key_sha256" not in fields:
        raise FieldError(name, None, "key_sha256 is missing (the SHA-256 of the key, 64 hex characters)")
    value = fields["key_sha256"]
    if not isinstance(value, str) or not _SHA256_HEX.fullmatch(value):
        raise FieldError(name, "key_sha256", "key_sha256 must be 64 hex characters (the SHA-256 of the key, "
                         "never the key itself)")
    return value.lower()


def _int_field(name: str, fields: Mapping, key: str, default: int) -> int:
    value = fields.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise FieldError(name, key, f"{key} must be an integer, got {value!r}")
    return value


def _limit_field(name: str, fields: Mapping, key: str) -> Optional[int]:
    if key not in fields:
        return None  # absent = unlimited
    value = _int_field(name, fields, key, 0)
    if value < 1:
        raise FieldError(name, key, f"{key} must be a positive integer (leave it out for no limit), got {value}")
    return value
