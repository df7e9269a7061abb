"""ReplicaBoard: a one-replica deployment where every engine replica reports its metrics each second, so that
the ingress can serve them all on its /metrics and know which replicas are alive (a replica that stops
reporting drops off after `max_age_s`)."""

from __future__ import annotations

import time

REPORT_PERIOD_S = 1.0
REPORT_MAX_AGE_S = 5.0


class ReplicaBoard:
    def __init__(self) -> None:
        self._reports: dict[str, tuple[float, str]] = {}

    def report(self, replica_id: str, metrics_text: str) -> None:
        self._reports[replica_id] = (time.monotonic(), metrics_text)

    def leave(self, replica_id: str) -> None:
        self._reports.pop(replica_id, None)

    def snapshot(self, max_age_s: float = REPORT_MAX_AGE_S) -> dict[str, str]:
        """Replica id -> its last metrics text, for replicas heard from within `max_age_s`."""
        now = time.monotonic()
        for replica_id in [r for r, (t, _) in self._reports.items() if now - t > max_age_s]:
            del self._reports[replica_id]
        return {r: text for r, (_, text) in self._reports.items()}
