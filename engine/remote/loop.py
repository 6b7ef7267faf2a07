"""One asyncio event loop in a daemon thread, for the async openai client.

The engine API is synchronous (a generator of events read by a worker thread), but a blocking read cannot be
interrupted from outside: cancelling a reply would wait for the server's next byte. On an event loop a
cancelled task stops its read at once and its `async with` closes the connection, which is how the server
learns the client left (and stops generating).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any


class LoopThread:
    def __init__(self, name: str = "ninfer-remote"):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule `coro` on the loop; cancelling the future cancels the task."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine, timeout: float | None = None) -> Any:
        """Run `coro` on the loop and wait for its result (its exception is raised here)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def close(self) -> None:
        """Cancel what still runs, finish the async generators (a stream's), then stop and close the loop."""
        if self.loop.is_closed():
            return

        async def wind_down():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()
        with contextlib.suppress(Exception):  # closing: nothing left to report to
            self.run(wind_down(), timeout=5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self.loop.close()
