"""`pagedserve bench serve --tenants`: several tenants, each with its own API key and request mix, load one
server at the same time.

Each tenant is one SPEC of comma-separated KEY=VALUE pairs, for example
`name=flood,api_key=KEY1,num_prompts=200,request_rate=inf` and
`name=interactive,api_key_env=KEY2_VAR,num_prompts=15,request_rate=0.5,arrivals=uniform,priority=0`.

* name (required, unique): the tenant's name in the report and the result JSON;
* api_key, or api_key_env (the name of an environment variable holding the key): sent as
  `Authorization: Bearer <key>`; with neither, the tenant sends no Authorization header. Keys are never
  printed nor saved;
* num_prompts, request_rate, burstiness, max_concurrency, random_input_len, random_output_len: as the global
  flags of the same name, which are the defaults of the keys a tenant does not give;
* arrivals: poisson (the default: gamma gaps of shape `burstiness` and mean 1/request_rate, as for the
  global --request-rate) or uniform (the first request at t=0, then exactly 1/request_rate apart);
* priority: an integer sent as the request body's `priority` (vLLM's field: lower runs first); not sent when
  not given.

Tenant number i (from 0) builds its own requests from the global dataset flags and draws its own gaps, both
seeded with --seed + i, so tenants neither share prompts (random datasets) nor arrival times. All tenants
start at the same t=0, each with its own in-flight cap, and the run ends when every tenant is done. A
tenant's throughput is over its own duration: from t=0 to the end of its last request.
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

ARRIVALS = ("poisson", "uniform")
# Keys that replace the global flag of the same name (argparse's dest) for one tenant.
OVERRIDES = ("num_prompts", "request_rate", "burstiness", "max_concurrency", "random_input_len",
             "random_output_len")


@dataclass(frozen=True)
class TenantSpec:
    """One parsed --tenants SPEC; None means "the global flag's value"."""

    name: str
    api_key: Optional[str] = field(default=None, repr=False)  # repr=False: keep it out of logs and tracebacks
    num_prompts: Optional[int] = None
    request_rate: Optional[float] = None
    burstiness: Optional[float] = None
    max_concurrency: Optional[int] = None
    random_input_len: Optional[int] = None
    random_output_len: Optional[int] = None
    arrivals: str = "poisson"
    priority: Optional[int] = None


# ---------------------------------------------------------------------------------------------------------
# Parsing


def _integer(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError("not an integer") from None


def _number(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError("not a number") from None


def _at_least_one(raw: str) -> int:
    value = _integer(raw)
    if value < 1:
        raise ValueError("must be >= 1")
    return value


def _rate(raw: str) -> float:
    value = _number(raw)
    if not value > 0:  # also refuses nan
        raise ValueError("must be > 0 (inf for all at once)")
    return value


def _burstiness(raw: str) -> float:
    value = _number(raw)
    if not 0 < value < math.inf:
        raise ValueError("must be > 0 and finite")
    return value


def _arrivals(raw: str) -> str:
    if raw not in ARRIVALS:
        raise ValueError(f"must be one of {', '.join(ARRIVALS)}")
    return raw


CONVERTERS: dict[str, Callable[[str], object]] = {
    "num_prompts": _at_least_one, "request_rate": _rate, "burstiness": _burstiness,
    "max_concurrency": _at_least_one, "random_input_len": _at_least_one, "random_output_len": _at_least_one,
    "arrivals": _arrivals, "priority": _integer,
}
ACCEPTED_KEYS = ("name", "api_key", "api_key_env", *CONVERTERS)


def _split_pairs(text: str) -> dict[str, str]:
    """'a=1,b=2' -> {'a': '1', 'b': '2'}; a part without '=' or a key given twice is an error."""
    pairs: dict[str, str] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not KEY=VALUE (in a tenant SPEC)")
        if key in pairs:
            raise argparse.ArgumentTypeError(f"tenant key {key!r} given twice")
        pairs[key] = value.strip()
    return pairs


def _api_key(pairs: dict[str, str], tenant: str) -> Optional[str]:
    """The key from api_key=KEY or api_key_env=VAR (read now, so that a missing variable fails early)."""
    if "api_key" in pairs and "api_key_env" in pairs:
        raise argparse.ArgumentTypeError(f"tenant {tenant!r}: give api_key or api_key_env, not both")
    if "api_key_env" in pairs:
        var = pairs["api_key_env"]
        if not os.environ.get(var):
            raise argparse.ArgumentTypeError(f"tenant {tenant!r}: api_key_env={var}: {var} is not set or empty")
        return os.environ[var]
    if "api_key" in pairs and not pairs["api_key"]:
        raise argparse.ArgumentTypeError(f"tenant {tenant!r}: api_key is empty")
    return pairs.get("api_key")


def parse_tenant_spec(text: str) -> TenantSpec:
    """One --tenants SPEC -> TenantSpec (argparse `type=`). Errors are argparse.ArgumentTypeError naming the bad
    part; they never echo the API key."""
    pairs = _split_pairs(text)
    name = pairs.get("name", "")
    if not name:
        raise argparse.ArgumentTypeError(f"a tenant SPEC needs name=NAME (accepted keys: {', '.join(ACCEPTED_KEYS)})")
    values: dict = {"name": name, "api_key": _api_key(pairs, name)}
    for key, raw in pairs.items():
        if key in ("name", "api_key", "api_key_env"):
            continue
        convert = CONVERTERS.get(key)
        if convert is None:
            raise argparse.ArgumentTypeError(
                f"tenant {name!r}: unknown key {key!r} (accepted: {', '.join(ACCEPTED_KEYS)})")
        try:
            values[key] = convert(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"tenant {name!r}: {key}={raw!r}: {e}") from None
    return TenantSpec(**values)


def check_unique_names(specs: list[TenantSpec]) -> None:
    """Tenants are reported by name, so two with one name would be merged: refuse them."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(f"--tenants: the name {spec.name!r} is given to two tenants")
        seen.add(spec.name)


# ---------------------------------------------------------------------------------------------------------
# From a spec to its load and its report


def tenant_args(args: argparse.Namespace, spec: TenantSpec, index: int) -> argparse.Namespace:
    """The global flags with the tenant's own values in place, and --seed + index (see the module's doc)."""
    own = {key: getattr(spec, key) for key in OVERRIDES if getattr(spec, key) is not None}
    return argparse.Namespace(**{**vars(args), **own, "seed": args.seed + index})


def bearer(key: Optional[str]) -> Optional[dict[str, str]]:
    """The Authorization header of an API key, or None without a key."""
    return {"Authorization": f"Bearer {key}"} if key else None


def auth_headers(spec: TenantSpec) -> Optional[dict[str, str]]:
    """The tenant's Authorization header, or None when it has no key."""
    return bearer(spec.api_key)


def body_fields(spec: TenantSpec) -> dict:
    """Fields added to every request body of the tenant: `priority` only when the spec gives one."""
    return {} if spec.priority is None else {"priority": spec.priority}


def tenant_entry(spec: TenantSpec, args: argparse.Namespace, metrics: dict) -> dict:
    """The tenant's object in the result JSON: its load (no key) and its metrics (compute_metrics' keys)."""
    rate = args.request_rate
    return {
        "num_prompts": args.num_prompts,
        "request_rate": "inf" if rate == math.inf else rate,
        "arrivals": spec.arrivals,
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "priority": spec.priority,
        **metrics,
    }
