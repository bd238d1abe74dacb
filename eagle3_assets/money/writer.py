"""The ledger from an event loop: operations run on one thread, as many per transaction as are waiting.

At a thousand requests a second each attempt is four ledger writes (reserve, send mark, generation
id, bill). One transaction per write would cost the loop ~0.2 ms each; here the loop only queues
them, and the writer thread commits whatever has queued while the previous commit ran (group
commit), each operation in its own savepoint so one failure spoils nothing else. A queued write
reaches the database within milliseconds; the journal, written synchronously first, covers that
window after a kill -9 (see settle.recover_dataset). The two writes a crash must find are awaited
(`call`): the reservation, and the send mark, committed before the request's first byte leaves
(concurrent sends share a commit, so the wait is one commit, not one per request).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import Any

from eagle3_assets.money.database import DATABASE_ERRORS
from eagle3_assets.money.ledger import ScopeBatch, SpendLedger

Done = Callable[[bool, Any], None] | None


class LedgerWriter:
    def __init__(self, ledger: SpendLedger, on_error: Callable[[str], None] = lambda message: None):
        self.ledger = ledger
        self.on_error = on_error
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="spend-ledger-writer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            stop = False
            while len(batch) < 4096:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                batch.append(nxt)
            self._commit(batch)
            if stop:
                return

    def _commit(self, batch: list[tuple[Callable[..., Any], tuple, dict, Done]]) -> None:
        outcomes: list[tuple[Done, bool, Any]] = []
        try:
            with self.ledger.transaction() as conn:
                scopes = ScopeBatch(conn)
                try:
                    for fn, args, kwargs, done in batch:
                        reads_scopes = getattr(fn, "reads_scopes", False)
                        if reads_scopes:  # it must see every sum so far (outside its savepoint: a rollback keeps them)
                            scopes.flush()
                        conn.execute("savepoint op")
                        try:
                            if reads_scopes:
                                with scopes.unbatched():
                                    result = fn(conn, *args, **kwargs)
                            else:
                                result = fn(conn, *args, **kwargs)
                            conn.execute("release op")
                            scopes.done(True)
                            outcomes.append((done, True, result))
                        except Exception as e:  # this operation only; the others commit
                            conn.execute("rollback to op")
                            conn.execute("release op")
                            scopes.done(False)
                            outcomes.append((done, False, e))
                finally:
                    scopes.close()
        except (
            DATABASE_ERRORS
        ) as e:  # the commit itself failed (disk full, locked too long, server gone): every operation failed
            outcomes = [(done, False, e) for _, _, _, done in batch]
        for done, ok, value in outcomes:
            if not ok and done is None:
                self.on_error(f"a spend ledger write failed ({type(value).__name__}: {value})")
            if done is not None:
                done(ok, value)

    def post(self, fn: Callable[..., Any], *args: Any, on_commit: Done = None, **kwargs: Any) -> None:
        """Queue a write; it is committed within milliseconds. `on_commit(ok, value)` runs on the writer thread."""
        self._queue.put((fn, args, kwargs, on_commit))

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run an operation in the next transaction and return its result once committed."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def done(ok: bool, value: Any) -> None:
            def resolve() -> None:
                if future.done():
                    return
                if ok:
                    future.set_result(value)
                else:
                    future.set_exception(value)

            try:
                loop.call_soon_threadsafe(resolve)
            except RuntimeError:  # the loop is gone (the run ended); the write itself is committed
                pass

        self._queue.put((fn, args, kwargs, done))
        return await future

    async def flush(self) -> None:
        """Everything queued so far is committed."""
        await self.call(lambda conn: None)

    def close(self) -> None:
        """Commit what is queued and stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> LedgerWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
