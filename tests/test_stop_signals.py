"""A stop signal inside a running asyncio loop: never swallowed, always a clean cancel, then handed back."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import textwrap

import pytest

from eagle3_assets.common.stop_signals import StopSignals


class Interrupted(BaseException):
    """Like Dagster's DagsterExecutionInterruptedError: a BaseException that is not KeyboardInterrupt."""


@contextlib.contextmanager
def sigint(handler):
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture
def raising_sigint():
    def handler(_signum, _frame):
        raise Interrupted()

    with sigint(handler):
        yield


async def work(log: list[str], signal_from_a_task: bool) -> None:
    async def signaller() -> None:
        await asyncio.sleep(0.05)
        signal.raise_signal(signal.SIGINT)  # the handler runs inside this task's step, as under load
        log.append("signaller went on")

    async def worker() -> None:
        try:
            await asyncio.sleep(30)
            log.append("worker finished")
        except asyncio.CancelledError:
            log.append("worker aborted")  # where a request in flight is journaled
            raise

    tasks = [asyncio.create_task(worker())]
    if signal_from_a_task:
        tasks.append(asyncio.create_task(signaller()))
    await asyncio.gather(*tasks)


def test_without_it_an_interrupt_raised_in_a_task_is_swallowed(raising_sigint: None) -> None:
    # The failure this module exists for: the interrupt dies with the task it landed in and the work goes on.
    log: list[str] = []

    async def main() -> None:
        w = asyncio.create_task(work(log, signal_from_a_task=True))
        await asyncio.sleep(0.3)
        w.cancel()  # only so that this test ends: nothing else would stop the work
        await asyncio.gather(w, return_exceptions=True)

    asyncio.run(main())
    assert log == ["worker aborted"]  # the signaller died silently; the worker was cancelled by the test itself


def test_an_interrupt_raised_in_a_task_cancels_the_work_then_reaches_the_previous_handler(raising_sigint: None) -> None:
    log: list[str] = []
    with pytest.raises(Interrupted):
        with StopSignals() as signals:

            async def main() -> None:
                signals.attach()
                await work(log, signal_from_a_task=True)

            asyncio.run(main())
    assert "worker aborted" in log and "worker finished" not in log
    assert signals.description == "SIGINT received"
    previous = signal.getsignal(signal.SIGINT)
    assert callable(previous) and previous.__name__ == "handler"  # the previous handler is back


def test_ctrl_c_becomes_keyboard_interrupt_after_a_clean_cancel() -> None:
    log: list[str] = []
    with sigint(signal.default_int_handler):
        with pytest.raises(KeyboardInterrupt):
            with StopSignals() as signals:

                async def main() -> None:
                    signals.attach()
                    asyncio.get_running_loop().call_later(0.05, signal.raise_signal, signal.SIGINT)  # from a callback
                    await work(log, signal_from_a_task=False)

                asyncio.run(main())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert log == ["worker aborted"]


def test_a_second_signal_is_handed_back_at_once_and_only_once():
    calls = []

    def handler(_signum, _frame):
        calls.append("previous handler")
        raise KeyboardInterrupt()

    with sigint(handler), pytest.raises(KeyboardInterrupt):
        with StopSignals() as signals:

            async def main() -> None:
                signals.attach()
                signal.raise_signal(signal.SIGINT)  # the first: a clean cancel is under way
                assert calls == []
                signal.raise_signal(signal.SIGINT)  # the second: the previous handler, right here
                calls.append("not reached")

            asyncio.run(main())
    assert calls == ["previous handler"]


def test_a_signal_before_the_loop_starts_cancels_it_at_once() -> None:
    log: list[str] = []
    with sigint(signal.default_int_handler), pytest.raises(KeyboardInterrupt):
        with StopSignals() as signals:
            signal.raise_signal(signal.SIGINT)

            async def main() -> None:
                signals.attach()
                log.append("started")
                await asyncio.sleep(30)
                log.append("slept")

            asyncio.run(main())
    assert log == ["started"]


def test_an_ignored_signal_stays_ignored():
    with sigint(signal.SIG_IGN):
        with StopSignals() as signals:

            async def main() -> str:
                signals.attach()
                signal.raise_signal(signal.SIGINT)
                await asyncio.sleep(0.05)
                return "done"

            assert asyncio.run(main()) == "done"
        assert signals.received is None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_sigterm_with_its_default_action_still_ends_the_process_but_after_the_cleanup(tmp_path):
    marker = tmp_path / "cleanup"
    script = textwrap.dedent(f"""
        import asyncio, os, signal
        from eagle3_assets.common.stop_signals import StopSignals

        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not inherited from the test run (Dagster remaps it)
        with StopSignals() as signals:
            async def main():
                signals.attach()
                asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
                try:
                    await asyncio.sleep(30)
                finally:
                    open({str(marker)!r}, "w").write("journal closed")
            try:
                asyncio.run(main())
            finally:
                open({str(marker)!r}, "a").write(", end record written")
        print("not reached")
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM, proc.stderr
    assert marker.read_text() == "journal closed, end record written"
    assert "not reached" not in proc.stdout
