"""The keys file of `pagedserve serve --api-keys-file`: named tenants with hashed keys, scopes, priorities, limits.

TOML (any name but `*.json`), one table per tenant::

    [tenants.chat-frontend]
    key_sha256 = "<64 hex chars>"   # SHA-256 of the key, never the key itself
    scope = "user"                  # "admin" or "user" (default "user")
    priority = 0                    # default priority of its requests (lower runs first; default 0)
    min_priority = 0                # the best (lowest) priority a user key may ask for (default: priority)
    requests_per_minute = 600       # the limits are optional; absent = unlimited
    tokens_per_minute = 200000      # prompt + max_tokens * n reserved up front, the unused part refunded
    max_concurrent_requests = 16

    [tenants.batch-jobs]
    key_sha256 = "..."
    priority = 10

JSON (`*.json`), the same shape: `{"tenants": {"chat-frontend": {"key_sha256": "...", "scope": "user"}}}`.

Tenant names are 1-64 of A-Z a-z 0-9 . _ - ; no two tenants may share a key. Anything else (an unknown field, a
wrong type, a bad scope, a hash that is not 64 hex characters, a negative or zero limit, min_priority above
priority) refuses the whole file with a ValueError "FILE:LINE: problem". `pagedserve keys add NAME` makes a key
and appends its tenant (`add_tenant`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
import tempfile
from typing import Any, Optional

from pagedserve.tenants.tenant import FieldError, Tenant

TOP_LEVEL = ("tenants",)


def is_json(path: str) -> bool:
    return path.lower().endswith(".json")


def load_tenants(path: str) -> list[Tenant]:
    """The tenants of a keys file, in file order; ValueError "PATH:LINE: problem" when anything is wrong."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the keys file: {e.strerror or e}") from None
    return parse_tenants(text, path)


def parse_tenants(text: str, path: str) -> list[Tenant]:
    """The tenants of a keys file's text (JSON when `path` ends in .json, else TOML)."""
    data = _parse_json(text, path) if is_json(path) else _parse_toml(text, path)
    if not isinstance(data, dict):
        raise ValueError(f"{path}:1: the keys file must be a table/object with a `tenants` table")
    for key in data:
        if key not in TOP_LEVEL:
            raise ValueError(f"{path}:{_key_line(text, key)}: unknown top-level key {key!r} (only `tenants`)")
    tables = data.get("tenants", {})
    if not isinstance(tables, dict):
        raise ValueError(f"{path}:{_key_line(text, 'tenants')}: `tenants` must be a table of tenants")
    tenants = []
    for name, fields in tables.items():
        try:
            tenants.append(Tenant.from_fields(name, fields))
        except FieldError as e:
            raise ValueError(f"{path}:{_field_line(text, e.tenant, e.field)}: {e}") from None
    _check_unique_keys(tenants, text, path)
    return tenants


def _parse_toml(text: str, path: str) -> Any:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the same parser as the tomli package
        import tomli as tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        found = re.search(r"at line (\d+)", str(e))
        line = getattr(e, "lineno", None) or (int(found.group(1)) if found else 1)
        raise ValueError(f"{path}:{line}: invalid TOML: {e}") from None


def _parse_json(text: str, path: str) -> Any:
    def no_duplicates(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen[key] = value
        return seen

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
    except _DuplicateKey as e:
        raise ValueError(f"{path}:{_key_line(text, e.key, occurrence=2)}: {e.key!r} appears twice") from None


class _DuplicateKey(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _check_unique_keys(tenants: list[Tenant], text: str, path: str) -> None:
    owners: dict[str, str] = {}
    for tenant in tenants:
        other = owners.setdefault(tenant.key_sha256, tenant.name)
        if other != tenant.name:
            line = _field_line(text, tenant.name, "key_sha256")
            raise ValueError(f"{path}:{line}: tenant {tenant.name!r} has the same key_sha256 as tenant {other!r}: "
                             "every tenant needs a key of its own")


# -- locating the line of a problem ---------------------------------------------------------------------------

def _key_pattern(key: str, separators: str) -> re.Pattern:
    """`key` used as a TOML/JSON key (bare or quoted), followed by one of `separators`."""
    return re.compile(rf"(?<![A-Za-z0-9_-])([\"']?){re.escape(key)}\1\s*[{re.escape(separators)}]")


def _find_line(lines: list[str], pattern: re.Pattern, start: int = 0, occurrence: int = 1) -> Optional[int]:
    """0-based index of the `occurrence`-th line at or after `start` that matches (comment lines skipped)."""
    for i in range(start, len(lines)):
        if not lines[i].lstrip().startswith("#") and pattern.search(lines[i]):
            occurrence -= 1
            if occurrence == 0:
                return i
    return None


def _key_line(text: str, key: str, occurrence: int = 1) -> int:
    found = _find_line(text.splitlines(), _key_pattern(key, "]=:."), occurrence=occurrence)
    return 1 if found is None else found + 1


def _field_line(text: str, tenant: str, field: Optional[str]) -> int:
    """1-based line of a tenant's field (its table header when `field` is None or cannot be found)."""
    lines = text.splitlines()
    start = _find_line(lines, _key_pattern(tenant, "]=:.{"))
    if start is None:
        return 1
    if field is not None:
        found = _find_line(lines, _key_pattern(field, "=:"), start)
        if found is not None:
            return found + 1
    return start + 1


# -- writing ----------------------------------------------------------------------------------------------------

def add_tenant(path: str, tenant: Tenant) -> None:
    """Append a tenant to a keys file (created when missing). Refuses a bad file, a name that exists and a key
    that another tenant has; the file is replaced atomically, TOML comments kept."""
    text = ""
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            text = f.read()
    existing = parse_tenants(text, path) if text.strip() else []
    if any(t.name == tenant.name for t in existing):
        raise ValueError(f"{path}: a tenant named {tenant.name!r} exists already")
    new_text = _with_json_tenant(text, tenant) if is_json(path) else _with_toml_tenant(text, tenant)
    parse_tenants(new_text, path)  # the result must load (e.g. not after an inline `tenants = {...}`)
    _replace_file(path, new_text)


def _with_toml_tenant(text: str, tenant: Tenant) -> str:
    name = tenant.name if re.fullmatch(r"[A-Za-z0-9_-]+", tenant.name) else json.dumps(tenant.name)
    today = datetime.date.today().isoformat()
    block = [f"# added by `pagedserve keys add` on {today}", f"[tenants.{name}]"]
    block += [f"{key} = {json.dumps(value)}" for key, value in tenant.to_fields().items()]
    separator = "" if not text else ("\n" if text.endswith("\n") else "\n\n")
    return text + separator + "\n".join(block) + "\n"


def _with_json_tenant(text: str, tenant: Tenant) -> str:
    data = json.loads(text) if text.strip() else {}
    data.setdefault("tenants", {})[tenant.name] = tenant.to_fields()
    return json.dumps(data, indent=2) + "\n"


def _replace_file(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".keys-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        if os.path.exists(path):
            os.chmod(tmp, os.stat(path).st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
