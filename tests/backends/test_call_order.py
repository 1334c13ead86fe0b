"""``CallOrderPool``: the jobs of the oldest call run first (see ``backends/_call_order.py``)."""

from __future__ import annotations

import contextvars
import threading
from concurrent.futures import CancelledError, Future

import pytest

from hicache_store.backends._call_order import CallOrderPool, one_call


def gate(pool: CallOrderPool) -> tuple[threading.Event, Future[None]]:
    """A job that holds the pool's one thread until the event is set."""
    release, running = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        release.wait()

    held = pool.submit(hold)
    assert running.wait(10)
    return release, held


def test_a_later_step_of_an_older_call_runs_before_newer_calls() -> None:
    pool = CallOrderPool(1, "t")
    ran: list[str] = []
    with one_call():
        release, _ = gate(pool)
        older = contextvars.copy_context()  # the call's context, for its later step
    outside = pool.submit(ran.append, "outside, after the older call began")
    with one_call():
        newer = pool.submit(ran.append, "newer call")
    later_step = older.run(pool.submit, ran.append, "older call, second step")
    release.set()
    for job in (outside, newer, later_step):
        job.result(10)
    # A first-in-first-out pool would have run them as submitted: the older call's second
    # step last, behind every call that began after it.
    assert ran == ["older call, second step", "outside, after the older call began", "newer call"]
    pool.shutdown()


def test_jobs_outside_calls_run_first_come_first_served() -> None:
    pool = CallOrderPool(1, "t")
    release, _ = gate(pool)
    jobs = [pool.submit(lambda i=i: i) for i in range(20)]
    order: list[int] = []
    for job in jobs:
        job.add_done_callback(lambda f: order.append(f.result()))
    release.set()
    assert [job.result(10) for job in jobs] == list(range(20))
    assert order == list(range(20))
    pool.shutdown()


def test_a_nested_call_keeps_the_outer_calls_number() -> None:
    with one_call() as outer, one_call() as inner:
        assert inner == outer
    with one_call() as later:
        assert later > outer


def test_threads_start_as_needed_up_to_the_limit() -> None:
    pool = CallOrderPool(2, "t")
    release = threading.Event()
    started = threading.Semaphore(0)

    def hold() -> str:
        started.release()
        release.wait()
        return threading.current_thread().name

    jobs = [pool.submit(hold) for _ in range(3)]
    assert started.acquire(timeout=10) and started.acquire(timeout=10)
    assert not started.acquire(timeout=0.2), "a third thread was started past the limit"
    release.set()
    names = {job.result(10) for job in jobs}
    assert names <= {"t_0", "t_1"}
    pool.shutdown()


def test_an_exception_reaches_the_future() -> None:
    pool = CallOrderPool(1, "t")
    job = pool.submit(int, "not a number")
    with pytest.raises(ValueError):
        job.result(10)
    pool.shutdown()


def test_shutdown_runs_what_is_queued_unless_told_to_cancel_it() -> None:
    pool = CallOrderPool(1, "t")
    release, held = gate(pool)
    queued = pool.submit(lambda: "ran")
    release.set()
    pool.shutdown(wait=True)
    assert queued.result(0) == "ran" and held.done()
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(lambda: None)

    pool = CallOrderPool(1, "t")
    release, held = gate(pool)
    queued = pool.submit(lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    release.set()
    with pytest.raises(CancelledError):
        queued.result(10)
    held.result(10)
