"""EngineCoreClient's shutdown: a core that exits is not reported as hung, nor killed, when join() returns early."""

import time

from pagedserve.engine.core_client import exits_within


class _Exiting:
    """A process whose join() returns at once and that looks alive for its first `alive_checks` is_alive() calls:
    what multiprocessing shows while another thread is reaping it."""

    def __init__(self, alive_checks: int) -> None:
        self.alive_checks, self.joins = alive_checks, 0

    def join(self, timeout=None) -> None:
        self.joins += 1

    def is_alive(self) -> bool:
        self.alive_checks -= 1
        return self.alive_checks >= 0


def test_a_process_still_being_reaped_after_join_counts_as_exited():
    process = _Exiting(alive_checks=3)
    start = time.monotonic()
    assert exits_within(process, timeout=10.0, poll_s=0.001)
    assert process.joins == 1 and time.monotonic() - start < 1.0


def test_a_process_alive_past_the_timeout_has_not_exited():
    start = time.monotonic()
    assert not exits_within(_Exiting(alive_checks=10**9), timeout=0.05, poll_s=0.001)
    assert 0.05 <= time.monotonic() - start < 1.0


def test_a_process_that_exited_during_join_has_exited():
    assert exits_within(_Exiting(alive_checks=0), timeout=1.0)
