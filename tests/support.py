"""Helpers for tests that drive real processes: ports, waiting, stopping a process group."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

from aiohttp import web


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str, every: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")


def stop_group(proc: subprocess.Popen) -> None:
    """Stop a process started with start_new_session=True, and everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class Webhook:
    """A loopback webhook receiver that keeps every alert it is sent."""

    def __init__(self):
        self.alerts = []
        self.app = web.Application()
        self.app.router.add_post("/hook", self.receive)

    async def receive(self, request):
        self.alerts.append(await request.json())
        return web.Response(text="ok")
