"""Work a test module hands off to other processes (gloo rank launches, subprocesses), run on
a background thread of the pytest process.

A suite on two cores spends most of its time in such launches, while most of its tests run
in the pytest process on one core. ``tests/conftest.py`` starts the jobs of every module with
a selected test once the tests are collected, one at a time in the order they were declared
(module order, as pytest runs them), so the in-process tests run on the core a launch leaves.

A module declares a job at import, ``JOB = in_background(fn, *args, **kwargs)``, and a test
reads ``JOB.result()``: it waits for the job, or runs it there when no session started it.
"""

from __future__ import annotations

import multiprocessing
import sys
import threading
from concurrent.futures import Future


class Job:
    """``fn(*args, **kwargs)``, run at most once; ``module`` declared it."""

    def __init__(self, module: str, fn, args: tuple, kwargs: dict):
        self.module, self._call = module, (fn, args, kwargs)
        self._future: Future = Future()
        self._started = False
        self._lock = threading.Lock()

    def run(self) -> None:
        """Run the call unless it already ran (or runs); its result or error goes to ``result``."""
        with self._lock:
            if self._started:
                return
            self._started = True
        fn, args, kwargs = self._call
        try:
            self._future.set_result(fn(*args, **kwargs))
        except BaseException as e:  # noqa: BLE001  (handed to the test that reads the result)
            self._future.set_exception(e)

    def result(self):
        self.run()
        return self._future.result()


_DECLARED: list[Job] = []
"""Every job the imported test modules declared, in order."""
_QUEUED: list[Job] = []
"""Those the background thread still has to run."""


def in_background(fn, /, *args, **kwargs) -> Job:
    """Declare ``fn(*args, **kwargs)`` as a job of the calling module."""
    job = Job(sys._getframe(1).f_globals["__name__"], fn, args, kwargs)
    _DECLARED.append(job)
    return job


def start(modules: set[str]) -> int:
    """Run the jobs ``modules`` declared, one after the other, on a background thread; how many."""
    _QUEUED[:] = [job for job in _DECLARED if job.module in modules]

    def worker():
        while True:
            try:
                job = _QUEUED.pop(0)
            except IndexError:  # all run, or stop() dropped the rest
                return
            job.run()

    queued = len(_QUEUED)
    threading.Thread(target=worker, name="background jobs", daemon=True).start()
    return queued


def stop() -> None:
    """Drop the jobs not started (no test that runs reads them, or the session stopped early)
    and end the ranks of a launch still running (the only multiprocessing children), which
    the interpreter would wait for at exit."""
    _QUEUED.clear()
    for process in multiprocessing.active_children():
        process.terminate()
