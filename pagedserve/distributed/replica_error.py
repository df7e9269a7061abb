"""ReplicaError: an engine refusal or failure, sent back through Ray as data and raised again on the ingress as
the exception the server's routes map to a status (ValueError -> 400, QueueFullError -> 429,
EngineDeadError -> 503). Pickling the exceptions themselves would make Ray wrap them in its own types."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedserve.core.request import RequestIdInUseError
from pagedserve.engine.async_llm import EngineDeadError, QueueFullError

_KINDS = {"invalid": ValueError, "queue_full": QueueFullError, "dead": EngineDeadError}


@dataclass(frozen=True)
class ReplicaError:
    kind: str
    """invalid (ValueError), queue_full, id_in_use (RequestIdInUseError), unavailable (the replica's engine was
    not running when the request came) or dead (it died while running it); the last two are EngineDeadError."""
    message: str
    replica: Optional[str] = None

    @classmethod
    def of(cls, error: Exception, replica: Optional[str] = None) -> "ReplicaError":
        if isinstance(error, RequestIdInUseError):
            return cls("id_in_use", error.request_id, replica)
        if isinstance(error, QueueFullError):
            return cls("queue_full", str(error), replica)
        if isinstance(error, ValueError):
            return cls("invalid", str(error), replica)
        return cls("dead", str(error), replica)

    def exception(self) -> Exception:
        if self.kind == "id_in_use":
            return RequestIdInUseError(self.message)
        return _KINDS.get(self.kind, EngineDeadError)(self.message)
