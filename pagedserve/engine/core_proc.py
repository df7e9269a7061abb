"""The engine-core process: an EngineCore stepping in a process of its own, talking over one pipe.

    front end (API process)                       engine-core process
    CoreClient.add/abort/stop/call --pickled--> run_engine_core: apply every pending message, step once
    CoreClient reader thread   <----pickled---- ("outputs", [EngineCoreOutput], EngineStats, rejections)

Messages in: ("add", parent_id, [Request], max_num_waiting), ("abort", [child ids]),
("stop", child_id, stop_string), ("call", call_id, method name, args), ("fault", "step_error") (the next step
raises: fault injection), ("shutdown",).
Messages out: ("ready", CoreInfo) or ("failed", traceback text) once, then ("outputs", outputs, stats,
rejections) after every step or rejected add (rejections: [(request id, exception)], the parent's id for a
rejected add, a child's for a request the core gave up on while queued) and ("reply", call_id,
value or exception). The core never waits on its client: it sleeps on the pipe only when it has nothing to
run, and exits when the pipe closes (its front end is gone) or on "shutdown".
"""

from __future__ import annotations

import logging
import pickle
import signal
import traceback
from multiprocessing.connection import Connection

from pagedserve.config import EngineConfig
from pagedserve.core.request import RequestStatus
from pagedserve.logging_utils import LoggingConfig, configure_logging

logger = logging.getLogger(__name__)

KV_COMMIT_AT_START_BYTES = 1 << 30
"""KV-cache memory committed before the core reports ready (its first ~1 GiB of blocks, the ones a fresh
pool hands out first); the rest is committed while it is idle (EngineCore.commit_kv_memory). Committing all
of the default 4 GiB first took 9 s of start-up on the project's VMs."""

CALLABLE = ("reset_prefix_cache", "stats", "add_lora", "remove_lora", "list_loras")
"""EngineCore methods a front end may call by name."""


def run_engine_core(config: EngineConfig, conn: Connection,
                    logging_config: LoggingConfig = LoggingConfig()) -> None:
    """The engine-core process's main function (multiprocessing target); it logs as its front end does."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which shuts us down
    configure_logging(logging_config, process_name="engine core")
    try:
        from pagedserve.engine.core import EngineCore

        core = EngineCore(config, kv_commit_at_start=KV_COMMIT_AT_START_BYTES)
    except BaseException:  # noqa: BLE001 - the front end re-raises it with this text
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("ready", core.info))
    try:
        _loop(core, conn)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        logger.info("front end gone; engine core exits")
    except Exception:  # noqa: BLE001 - the front end sees the pipe close (EngineDeadError, maybe a restart)
        logger.exception("engine core failed; exiting")
        raise SystemExit(1)
    finally:
        core.shutdown()


class InjectedFault(RuntimeError):
    """A failure a front end asked for (AsyncLLM.inject_fault), to test what follows an engine crash."""


def _loop(core, conn: Connection) -> None:
    faults: set[str] = set()
    while True:
        rejections: list = []
        if not core.has_unfinished_requests() and not conn.poll(0):
            if core.commit_kv_memory():  # idle: commit some of the KV cache's memory, then look again
                continue
            conn.poll(None)  # idle, all committed: sleep until there is a message
        while conn.poll(0):
            message = pickle.loads(conn.recv_bytes())
            if message[0] == "shutdown":
                core.finish_requests(list(core.scheduler.requests))
                return
            if message[0] == "fault":
                faults.add(message[1])
                continue
            _apply(core, conn, message, rejections)
        if "step_error" in faults and core.has_unfinished_requests():
            raise InjectedFault("a step failed (fault injected by the front end)")
        outputs = core.step() if core.has_unfinished_requests() else []
        rejections += core.take_rejected()  # child ids: the front end finds their parent
        # Every pass either stepped or applied messages: the front end gets the outputs and fresh gauges.
        conn.send_bytes(pickle.dumps(("outputs", outputs, core.stats(), rejections), pickle.HIGHEST_PROTOCOL))


def _apply(core, conn: Connection, message: tuple, rejections: list) -> None:
    kind = message[0]
    if kind == "add":
        _, parent_id, children, max_num_waiting = message
        try:
            core.add_requests(children, max_num_waiting)
        except Exception as e:  # noqa: BLE001 - ValueError / QueueFullError go back to the one request
            rejections.append((parent_id, e))
    elif kind == "abort":
        core.finish_requests(message[1])
    elif kind == "stop":
        core.finish_requests([message[1]], RequestStatus.FINISHED_STOPPED, stop_reason=message[2])
    elif kind == "call":
        _, call_id, name, args = message
        try:
            if name not in CALLABLE:
                raise ValueError(f"the engine core has no callable {name!r}")
            reply = getattr(core, name)(*args)
        except Exception as e:  # noqa: BLE001 - raised again on the caller's side
            reply = e
        conn.send_bytes(pickle.dumps(("reply", call_id, reply), pickle.HIGHEST_PROTOCOL))
    else:
        raise ValueError(f"unknown engine-core message {kind!r}")
