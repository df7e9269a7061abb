"""Rebuilding a dead engine core in place (`pagedserve serve --restart-on-engine-failure`, the default).

When the engine-core process dies (an exception in a step, a kill, the OOM killer), the requests in flight
have already failed with EngineDeadError (503) and /health says 503. The restarter then starts a new core
process on a thread of its own, with a backoff between failed attempts, and hands it to the front end, which
serves again without a restart of the server process.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class CoreRestarter:
    def __init__(self, start_core: Callable[[], object], adopt: Callable[[object], bool],
                 on_restart: Callable[[int], None]) -> None:
        """`start_core()` builds and starts a new core client (raising if it cannot start); `adopt(client)` makes
        it the front end's (False when the front end is shutting down: the client is then shut down here);
        `on_restart(count)` runs after each restart (the metrics)."""
        self._start_core, self._adopt, self._on_restart = start_core, adopt, on_restart
        self._lock = threading.Lock()
        self._running = self._again = False
        self._stopped = threading.Event()
        self.restarts = 0

    def core_died(self) -> None:
        """Start rebuilding; a death reported while a rebuild runs (the new core died at once) makes that
        rebuild go round again."""
        with self._lock:
            if self._stopped.is_set():
                return
            if self._running:
                self._again = True
                return
            self._running, self._again = True, False
        threading.Thread(target=self._rebuild, name="pagedserve-core-restarter", daemon=True).start()

    def stop(self) -> None:
        """No more rebuilds (the front end is shutting down); one in progress gives its core up."""
        self._stopped.set()

    def _rebuild(self) -> None:
        while True:
            self._rebuild_once()
            with self._lock:
                if not self._again or self._stopped.is_set():
                    self._running = False
                    return
                self._again = False

    def _rebuild_once(self) -> None:
        backoff, started = FIRST_BACKOFF_S, time.monotonic()
        while not self._stopped.is_set():
            try:
                client = self._start_core()
            except Exception as e:  # noqa: BLE001 - a core that cannot start: try again later
                logger.error("engine core restart failed (%s); retrying in %.0f s", e, backoff)
                if self._stopped.wait(backoff):
                    return
                backoff = min(2 * backoff, MAX_BACKOFF_S)
                continue
            if self._adopt(client):
                self.restarts += 1
                logger.warning("engine core restarted (restart %d, %.1f s after it died); serving again",
                               self.restarts, time.monotonic() - started)
                self._on_restart(self.restarts)
            return
