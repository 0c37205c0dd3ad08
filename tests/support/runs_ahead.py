"""Run each selected test's subprocess one test ahead, two at a time; each test checks its own.

A lesson run spends much of its time starting processes and waiting on sockets and timeouts,
leaving a core idle: on this 2-core machine the 17 plain lesson runs took 63 s two at a time
and 83 s one after the other. A module's fixture builds a :class:`RunsAhead` from the tests
pytest selected (in the order they will run); each test calls :meth:`RunsAhead.result` with its
own id, which starts its run and the next test's (if not started yet) and waits for its own. A
failure is still reported by the test whose run failed, with its own message; a test that is not
selected runs nothing.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

#: One run, prepared in the main thread (pytest changes ``os.environ`` as tests go, so reading
#: it belongs there): called there, it returns the function that the pool runs, given a slot
#: (0 or 1: which of two warm interpreters, say, is free for it).
Prepare = Callable[[], Callable[[int], object]]


class RunsAhead:
    """The runs of ``tests`` (test id -> :data:`Prepare`, in the order the tests will run)."""

    def __init__(self, tests: dict[str, Prepare], at_once: int = 2):
        self.tests, self.order, self.at_once = tests, list(tests), at_once
        self.pool = ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="run-ahead")
        self.slots = queue.SimpleQueue()
        for slot in range(at_once):
            self.slots.put(slot)
        self.started: dict[str, Future] = {}

    def result(self, test_id: str):
        """This test's run's result, once it is done; or what its preparation or run raised."""
        index = self.order.index(test_id)
        for key in self.order[index:index + self.at_once]:
            if key not in self.started:
                self.started[key] = self._start(key)
        return self.started[test_id].result()

    def _start(self, test_id: str) -> Future:
        try:
            run = self.tests[test_id]()
        except BaseException as error:  # raised in its own test, not in the one ahead of it
            failed = Future()
            failed.set_exception(error)
            return failed
        return self.pool.submit(self._on_a_free_slot, run)

    def _on_a_free_slot(self, run: Callable[[int], object]):
        slot = self.slots.get()
        try:
            return run(slot)
        finally:
            self.slots.put(slot)

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # a run started ahead ends by itself


def selected(request, *functions: str) -> list:
    """The items pytest will run, of these test functions of the requesting module."""
    return [item for item in request.session.items
            if item.module is request.module and item.originalname in functions]
