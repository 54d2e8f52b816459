"""The network side both endpoints share: an asyncio loop on a thread of its own, and `Link`, one TCP
connection to a peer whose frames are written in order by one writer task.

The endpoint's caller (the engine loop) never waits on the network: it queues frames with
`Link.send` (from any thread) and reads what arrived through the endpoint's `poll()`. Every write is
drained within `send_timeout`, or the link is lost; a link is lost once (`on_lost(link, reason)`),
whether its reader saw the end of the stream, its writer failed, or the endpoint closed it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine
from typing import Any, Optional

from minisched.engine.kv_transfer import wire

log = logging.getLogger("minisched.kv_transfer")


class LoopThread:
    """An asyncio event loop running on a daemon thread until `stop()`."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        """Run coro on the loop; an exception it ends with is logged (a bug: the waits it kept are gone)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        future.add_done_callback(_log_failure)
        return future

    def call(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) on the loop's thread, in the order of the calls; dropped once the loop is stopped."""
        try:
            self.loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: the endpoint is shutting down
            pass

    def stop(self, timeout: float = 5.0) -> None:
        """Cancel every task, stop the loop and join its thread."""
        if self.loop.is_closed():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self.submit(cancel_all()).result(timeout)
        except (concurrent.futures.TimeoutError, RuntimeError):
            log.warning("kv transfer: tasks still running at shutdown")
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def _log_failure(future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("kv transfer: a network task failed", exc_info=future.exception())


Frame = Optional[tuple[bytes, Optional[memoryview], Optional[Callable[[], None]]]]  # None: close after the rest


class Link:
    """One connection to a peer. Made on the loop's thread; `send` and `close_after_sends` from any thread."""

    def __init__(
        self,
        loop: LoopThread,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        send_timeout: float,
        on_lost: Callable[[Link, str], None],
    ):
        self.reader, self._writer = reader, writer
        peer = writer.get_extra_info("peername")
        self.name = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self._loop, self._send_timeout, self._on_lost = loop, send_timeout, on_lost
        self._queue: asyncio.Queue[Frame] = asyncio.Queue()
        self.lost = False
        self.peer_max_frame_bytes = 0  # what the decode side accepts (its hello), on the prefill side
        self._task = loop.loop.create_task(self._write_all())

    def send(
        self,
        kind: wire.Kind,
        room: int = 0,
        meta: Optional[dict[str, Any]] = None,
        payload: Optional[memoryview] = None,
        after: Optional[Callable[[], None]] = None,
    ) -> None:
        """Queue one frame (written after every frame queued before it); `after` runs on the loop's
        thread once the frame is drained to the socket. A lost link drops it."""
        header = wire.encode(kind, room, meta, len(payload) if payload is not None else 0)
        self._loop.call(self._queue.put_nowait, (header, payload, after))

    def close_after_sends(self) -> None:
        self._loop.call(self._queue.put_nowait, None)

    async def _write_all(self) -> None:
        try:
            while (item := await self._queue.get()) is not None:
                header, payload, after = item
                if self.lost:
                    continue
                self._writer.write(header)
                if payload is not None:
                    self._writer.write(payload)
                await asyncio.wait_for(self._writer.drain(), self._send_timeout)
                if after is not None:
                    after()
            self.lose("was closed by this side")
        except asyncio.TimeoutError:
            self.lose(f"did not read what was sent for {self._send_timeout:g} s (send timed out)")
        except (ConnectionError, OSError) as exc:
            self.lose(f"closed the connection ({exc})")

    def lose(self, reason: str) -> None:
        """On the loop's thread: the link is gone; tell the endpoint once and close the socket."""
        if self.lost:
            return
        self.lost = True
        self._writer.close()
        if self._task is not asyncio.current_task():
            self._task.cancel()
        self._on_lost(self, reason)
