"""Serve an aiohttp app on 127.0.0.1 from a thread of this process: nothing is left behind."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web


class ServerThread:
    def __init__(self, app: web.Application, port: int = 0):
        self.app, self.port = app, port
        self._started = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=self._serve, name="loopback-server", daemon=True)

    def _serve(self) -> None:
        self._loop = asyncio.new_event_loop()
        runner = web.AppRunner(self.app, handler_cancellation=False)
        self._loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", self.port, backlog=4096)
        self._loop.run_until_complete(site.start())
        self.port = runner.addresses[0][1]
        self._started.set()
        self._loop.run_forever()
        self._loop.run_until_complete(runner.cleanup())
        self._loop.close()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        if not self._started.wait(15):
            raise RuntimeError("loopback server did not start")
        return self

    def __exit__(self, *exc) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(15)
