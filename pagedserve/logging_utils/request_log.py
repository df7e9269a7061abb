"""The server's access log: one line per HTTP request, written when its response is over, with what a log
pipeline wants to count (tenant, model or adapter, tokens, time to first token, total time, finish reason,
status). Prompt and completion text appear only when the operator asks for them (`--log-prompts`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Optional

from pagedserve.logging_utils.json_formatter import FIELDS_ATTR

logger = logging.getLogger("pagedserve.requests")

QUIET_ROUTES = ("/health", "/metrics")
"""Probes and scrapes: logged only when they fail (a line every few seconds would drown the requests)."""


@dataclass
class RequestRecord:
    """What a route learns about one HTTP request while serving it (filled in by the serving code)."""

    arrival: float = field(default_factory=time.monotonic)
    model: Optional[str] = None
    lora_adapter: Optional[str] = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    first_token: Optional[float] = None
    finish_reasons: dict[int, str] = field(default_factory=dict)
    """choice index -> finish reason"""
    num_choices: int = 0
    stream: bool = False
    prompts: list = field(default_factory=list)
    completions: dict[int, str] = field(default_factory=dict)
    """choice index -> text so far; kept only with --log-prompts"""

    def finish_reason(self, status: int = 200) -> Optional[str]:
        """One finish reason for the request: the choices' when they agree, else theirs in order, joined by
        commas; for choices that ended without one, "abort" (the client went away) or, when the response was an
        error (`status` 400 or more: the engine died, the queue was full), "error"."""
        if not self.num_choices:
            return None
        unfinished = "error" if status >= 400 else "abort"
        reasons = [self.finish_reasons.get(i, unfinished) for i in range(self.num_choices)]
        return reasons[0] if len(set(reasons)) == 1 else ",".join(reasons)


@dataclass(frozen=True)
class RequestLogConfig:
    enabled: bool = True
    log_prompts: bool = False
    max_log_len: Optional[int] = None
    """Characters of each prompt and completion kept in a line (None: all), as vLLM's --max-log-len."""


class RequestLog:
    def __init__(self, config: RequestLogConfig) -> None:
        self.config = config

    def wants(self, path: str, status: int) -> bool:
        return self.config.enabled and (path not in QUIET_ROUTES or status >= 400)

    def write(self, request_id: str, tenant: Optional[str], method: str, path: str, status: int,
              record: RequestRecord, replicas: list[str]) -> None:
        if not self.wants(path, status):
            return
        now = time.monotonic()
        fields = {"request_id": request_id, "tenant": tenant, "method": method, "path": path, "status": status,
                  "e2e_s": round(now - record.arrival, 6)}
        if record.model is not None:
            fields.update(self._generation_fields(record, status))
        if replicas:
            fields["replicas"] = replicas
        logger.info(_text(fields), extra={FIELDS_ATTR: fields})

    def _generation_fields(self, record: RequestRecord, status: int) -> dict:
        ttft = None if record.first_token is None else round(record.first_token - record.arrival, 6)
        fields = {"model": record.model, "lora_adapter": record.lora_adapter, "stream": record.stream,
                  "prompt_tokens": record.prompt_tokens, "completion_tokens": record.completion_tokens,
                  "cached_tokens": record.cached_tokens, "ttft_s": ttft,
                  "finish_reason": record.finish_reason(status)}
        if self.config.log_prompts:
            fields["prompt"] = [self._clip(p) for p in record.prompts]
            fields["completion"] = [self._clip(record.completions.get(i, "")) for i in range(record.num_choices)]
        return fields

    def _clip(self, value):
        limit = self.config.max_log_len
        return value[:limit] if isinstance(value, (str, list)) and limit is not None else value


def _text(fields: dict) -> str:
    """The line of the text format: the status line first, then the rest as key=value."""
    head = f"{fields['method']} {fields['path']} {fields['status']} request_id={fields['request_id']}"
    rest = " ".join(f"{k}={_short(v)}" for k, v in fields.items()
                    if k not in ("method", "path", "status", "request_id") and v is not None)
    return f"{head} {rest}"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, str) and (" " in value or not value):
        return repr(value)
    return str(value)
