"""The front end's handle on the engine-core process (core_proc.py): start it, send it messages, and read
what it sends back on a thread of its own.

The reader thread hands every ("outputs", ...) message to `on_outputs(outputs, stats, rejections)` and calls
`on_dead(reason)` once when the pipe closes (the core exited, crashed or was killed), so that the front end
fails what is in flight instead of waiting forever.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import pickle
import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Optional

from pagedserve.config import EngineConfig
from pagedserve.engine.core_output import CoreInfo
from pagedserve.engine.core_proc import run_engine_core
from pagedserve.logging_utils import current_logging

logger = logging.getLogger(__name__)


class EngineCoreClient:
    def __init__(self, config: EngineConfig, on_outputs: Callable, on_dead: Callable[[str], None]) -> None:
        """Start the engine-core process; `wait_ready()` then waits for its model to load."""
        context = multiprocessing.get_context("spawn")  # never fork a process that may hold OpenMP threads
        self._conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(target=run_engine_core, name="pagedserve-engine-core", daemon=True,
                                       args=(config, child_conn, current_logging()))
        self.process.start()
        child_conn.close()
        self._on_outputs, self._on_dead = on_outputs, on_dead
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._dead = False
        self._reader: Optional[threading.Thread] = None
        self._writer = threading.Thread(target=self._write, name="pagedserve-core-writer", daemon=True)
        self._writer.start()

    def wait_ready(self) -> CoreInfo:
        """Block until the core has loaded its model; its start-up error is raised here as a RuntimeError."""
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            self.process.join(5)
            raise RuntimeError(f"the engine-core process exited during start-up (exit code "
                               f"{self.process.exitcode})") from None
        if kind != "ready":
            self.process.join(5)
            raise RuntimeError(f"the engine core failed to start:\n{payload}")
        self._reader = threading.Thread(target=self._read, name="pagedserve-core-reader", daemon=True)
        self._reader.start()
        return payload

    # -- to the core ---------------------------------------------------------------------------------------

    def send(self, message: tuple) -> None:
        """Queue a message for the core (thread-safe, never blocks: a writer thread does the pipe write, so an
        event loop does not wait while the core is busy stepping and the pipe is full). Sending to a dead core
        is a no-op: on_dead has told the waiters."""
        if not self._dead:
            self._outbox.put(message)

    def _write(self) -> None:
        while True:
            message = self._outbox.get()
            if message is None or self._dead:
                return
            try:
                self._conn.send_bytes(pickle.dumps(message, pickle.HIGHEST_PROTOCOL))
            except (BrokenPipeError, ConnectionResetError, OSError):
                return  # the reader sees the closed pipe and reports it

    def call(self, name: str, timeout: Optional[float] = 10.0, args: tuple = ()):
        """Run a core method (core_proc.CALLABLE) with `args` between steps and return its result (or raise
        the exception it raised)."""
        future: Future = Future()
        call_id = next(self._call_ids)
        self._calls[call_id] = future
        self.send(("call", call_id, name, args))
        if self._dead and self._calls.pop(call_id, None) is not None and not future.done():
            future.set_exception(RuntimeError("the engine core is not running"))
        return future.result(timeout)

    # -- from the core -------------------------------------------------------------------------------------

    def _read(self) -> None:
        reason = "the engine-core process closed its pipe"
        try:
            while True:
                message = pickle.loads(self._conn.recv_bytes())
                if message[0] == "outputs":
                    self._on_outputs(*message[1:])
                elif message[0] == "reply":
                    future = self._calls.pop(message[1], None)
                    if future is not None:
                        (future.set_exception if isinstance(message[2], BaseException) else future.set_result)(
                            message[2])
        except (EOFError, OSError):
            exits_within(self.process, 1)  # not join(): shutdown() may be reaping it at the same moment
            reason = f"the engine-core process exited (exit code {self.process.exitcode})"
        except BaseException as e:  # noqa: BLE001 - a front-end bug must still fail the waiters
            logger.exception("engine-core reader failed")
            reason = f"the engine-core reader failed: {e!r}"
        finally:
            self._dead = True
            self._outbox.put(None)  # stops the writer
            for future in self._calls.values():
                future.set_exception(RuntimeError(reason))
            self._calls.clear()
            self._on_dead(reason)

    # -- lifetime ------------------------------------------------------------------------------------------

    def is_alive(self) -> bool:
        return not self._dead and self.process.is_alive()

    def shutdown(self, timeout: Optional[float] = 10.0) -> None:
        """Ask the core to abort everything and exit; kill it if it has not within `timeout`."""
        if self.process.is_alive():
            self.send(("shutdown",))
            if not exits_within(self.process, timeout):
                logger.warning("engine core did not exit within %s s; killing it", timeout)
                self.process.kill()
                self.process.join(5)
        self._outbox.put(None)  # the writer stops (the reader already has, unless the core never started)
        for thread in (self._reader, self._writer):
            if thread is not None and thread is not threading.current_thread():
                thread.join(5)
        self._conn.close()


def exits_within(process, timeout: Optional[float], poll_s: float = 0.01) -> bool:
    """Whether `process` (a multiprocessing.Process) has exited within `timeout` seconds (None: waits for it).
    join() can return early with is_alive() still True: when the core's pipe closes, the reader thread joins the
    process too, and if its waitpid() reaps the process first, this thread's fails (ECHILD), which multiprocessing
    reports as "still running" until the reaping thread has stored the exit code. Logged as "did not exit within
    10 s" after ~2 s, with a needless kill, in 4 of ~20 server stops; so this looks again until the time is up."""
    deadline = None if timeout is None else time.monotonic() + timeout
    process.join(timeout)
    while process.is_alive():
        if deadline is not None and time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True
