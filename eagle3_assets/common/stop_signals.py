"""Stop signals while an asyncio loop runs: cancel its main task cleanly, then hand the signal back.

A signal handler that raises (Python's KeyboardInterrupt for Ctrl-C; Dagster's
DagsterExecutionInterruptedError, which a UI terminate delivers to the step process as SIGINT)
raises wherever the loop happens to be. Inside a callback or a task step asyncio swallows every
BaseException but KeyboardInterrupt and SystemExit (it logs it, or stores it on the task), and
the run goes on spending: seen as a terminate that did not stop a step until the run's CANCELING
status was polled. So while the loop runs, SIGINT and SIGTERM only record the signal and cancel
the main task, as `asyncio.Runner` does for Ctrl-C; requests in flight are journaled as aborted;
and on leaving, the previous handlers come back and receive the signal, so the caller sees the
stop as it would have (Dagster's error, KeyboardInterrupt, or the default action of SIGTERM) once
the journal is closed. A second signal is handed back at once.

With `on_first` set (an operator's terminate in drain mode) the first signal only calls it (stop
admitting; requests in flight finish and are kept), the second cancels the main task, and the
third is handed back at once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopSignals:
    """Context manager around `asyncio.run`; the main coroutine calls `attach()` first."""

    def __init__(self) -> None:
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handed_back = False
        self.on_first: Callable[[], None] | None = None
        self._draining = False

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for sig in STOP_SIGNALS:
                previous = signal.getsignal(sig)
                if previous is signal.SIG_IGN or previous is None:
                    continue  # ignored (a job started in the background) or owned by non-Python code
                self._previous[sig] = previous
                signal.signal(sig, self._handle)
        return self

    def attach(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        if self.received is not None and self._task is not None:  # arrived before the loop started
            self._task.cancel()

    @property
    def description(self) -> str | None:
        return None if self.received is None else f"{self.received.name} received"

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.received is None and self.on_first is not None and self._loop is not None:
            self.received, self._draining = signal.Signals(signum), True
            self._loop.call_soon_threadsafe(self.on_first)
            return
        if self._draining:  # asked again while draining: cancel what is in flight now
            self._draining = False
            self._cancel_main_task()
            return
        if self.received is not None:  # asked twice: no more waiting for a clean stop
            self._restore()
            self._handed_back = True
            signal.raise_signal(signum)
            return
        self.received = signal.Signals(signum)
        self._cancel_main_task()

    def _cancel_main_task(self) -> None:
        # attach() sets the task and its loop together
        if self._task is not None and self._loop is not None and not self._task.done():
            self._task.cancel()
            self._loop.call_soon_threadsafe(lambda: None)  # wake a loop blocked in select()

    def _restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __exit__(self, exc_type: type[BaseException] | None, *_: object) -> None:
        self._restore()
        if self.received is not None and not self._handed_back:
            signal.raise_signal(self.received)  # the previous handler raises (or acts) here
            if exc_type is not None:  # it only took note (or was gone): the work was still cut short
                raise KeyboardInterrupt(self.description)
