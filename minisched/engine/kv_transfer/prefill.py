"""`PrefillTransfer`: the prefill worker's end. It runs the bootstrap server (SGLang's
`--disaggregation-bootstrap-port`) that decode workers connect to, and sends each room's KV pages.

    xfer = PrefillTransfer(kv_cache, "smollm2", port=8998)
    xfer.expect(room)                 # the request for `room` arrived (the router's bootstrap_room)
    for ev in xfer.poll():            # every step of the engine loop
        READY  -> run its prefill; ev.pages: pages the decode side reserved, ev.skip_pages: it has already
        DONE   -> the decode side holds the pages (the request's pages may go to the radix cache)
        FAILED -> abort the request (ev.error); the decode side has been told
    xfer.send_pages(room, pages)      # after each chunk's forward: the next full pages, gathered now
    xfer.finish(room, {"first_token": ...})   # after the last pages: the decode side's metadata
    xfer.abort(room, "client went away")      # any state; the decode side is told

Pages are gathered into a contiguous buffer on the caller's thread (`ops.gather_kv_pages`) when
`send_pages` is called, so they may be reused as soon as it returns; the buffers wait for the network
thread, bounded by the pages the decode side reserved for each room. Call the methods from one thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from minisched import ops
from minisched.engine.kv_transfer import wire
from minisched.engine.kv_transfer.config import TransferConfig
from minisched.engine.kv_transfer.layout import KVLayout, KVLayoutMismatch
from minisched.engine.kv_transfer.link import Link, LoopThread
from minisched.engine.kv_transfer.rooms import EventKind, PrefillState, RoomEvent, TransferStats, count_ends

log = logging.getLogger("minisched.kv_transfer")
ENDED = (PrefillState.DONE, PrefillState.FAILED)


@dataclass
class _Room:
    room: int
    state: PrefillState
    deadline: float  # of this module's wait in the current state (monotonic); inf: none
    claimed: bool = True  # False: the decode side spoke of it before the request reached this worker
    link: Optional[Link] = None
    pages: int = 0  # reserved by the decode side
    skip_pages: int = 0
    sent: int = 0
    error: Optional[str] = None


class PrefillTransfer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        model: str,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        config: TransferConfig = TransferConfig(),
        backend: ops.Backend = "native",
    ):
        self.layout = KVLayout.of(kv_cache, model)
        self.config = config
        self._kv, self._backend = kv_cache, backend
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._events: list[RoomEvent] = []
        self._aborted: dict[int, tuple[float, str]] = {}  # room -> (until, why): a late announcement gets an abort
        self._links: set[Link] = set()
        self._stats = TransferStats()
        self._closed = False
        self._net = LoopThread("kv-transfer-prefill")
        try:  # a port in use fails here (OSError), in the caller's thread
            start = asyncio.run_coroutine_threadsafe(
                asyncio.start_server(self._serve, host, port, limit=wire.STREAM_LIMIT), self._net.loop
            )
            self._server = start.result(30)
        except BaseException:
            self._net.stop()
            raise
        self.host, self.port = host, self._server.sockets[0].getsockname()[1]
        self._net.submit(self._watch())

    # -- the caller's side (one thread) --------------------------------------------------------------

    def expect(self, room: int) -> None:
        """The request for `room` reached this worker: wait for the decode side's announcement."""
        with self._lock:
            self._check_open()
            rec = self._rooms.get(room)
            if rec is not None and rec.claimed:
                raise ValueError(f"room {room} is expected already")
            self._aborted.pop(room, None)
            if rec is None:
                self._rooms[room] = _Room(room, PrefillState.BOOTSTRAPPING, self._now() + self.config.bootstrap_timeout)
                return
            rec.claimed, rec.deadline = True, math.inf  # the decode side came first
            if rec.state == PrefillState.FAILED:
                self._events.append(RoomEvent(room, EventKind.FAILED, error=rec.error))
            else:
                self._events.append(RoomEvent(room, EventKind.READY, pages=rec.pages, skip_pages=rec.skip_pages))

    def send_pages(self, room: int, pages: Sequence[int]) -> bool:
        """Send the room's next pages (pool page ids, in the order of the request's KV past skip_pages).
        False when the room has ended (a FAILED event is pending or was polled): stop computing it."""
        with self._lock:
            self._check_open()
            rec = self._live(room)
            if rec is None:
                return False
            if rec.state not in (PrefillState.READY, PrefillState.TRANSFERRING):
                raise ValueError(f"room {room} is {rec.state.value}: pages go after READY and before finish()")
            if rec.sent + len(pages) > rec.pages:
                raise ValueError(
                    f"room {room}: {rec.sent} + {len(pages)} pages > the {rec.pages} the decode side reserved"
                )
            start, link = rec.sent, rec.link
        assert link is not None
        limit = min(self.config.max_frame_bytes, link.peer_max_frame_bytes)
        per_frame = max(1, limit // self.layout.bytes_per_page)
        batches = [list(pages[i : i + per_frame]) for i in range(0, len(pages), per_frame)]
        buffers = [self._gather(batch) for batch in batches]  # a bad page id raises here: nothing has changed
        with self._lock:
            if self._live(room) is not rec:  # the network thread ended it meanwhile
                return False
            rec.sent += len(pages)
            rec.state = PrefillState.TRANSFERRING
            s = self._stats
            nbytes = len(pages) * self.layout.bytes_per_page
            self._stats = replace(s, pages=s.pages + len(pages), bytes=s.bytes + nbytes, frames=s.frames + len(batches))
        offset = start
        for batch, buf in zip(batches, buffers):
            link.send(wire.Kind.PAGES, room, {"start": offset, "n": len(batch)}, payload=buf)
            offset += len(batch)
        return True

    def finish(self, room: int, metadata: Optional[dict[str, Any]] = None) -> bool:
        """Every page is sent: tell the decode side, with `metadata` (JSON: the first token, prompt
        logprobs...). The room is DONE once the decode side confirms. False when the room has ended."""
        meta = {"pages": 0, "metadata": metadata or {}}
        size = len(json.dumps(meta))  # TypeError/ValueError here, in the caller's thread, if it is no JSON
        if size > self.config.max_meta_bytes:
            raise ValueError(f"room {room}: metadata of {size} bytes > max_meta_bytes {self.config.max_meta_bytes}")
        with self._lock:
            self._check_open()
            rec = self._live(room)
            if rec is None:
                return False
            if rec.state not in (PrefillState.READY, PrefillState.TRANSFERRING):
                raise ValueError(f"room {room} is {rec.state.value}: finish() comes after READY, once")
            rec.state = PrefillState.AWAITING_ACK
            link = rec.link
            meta["pages"] = rec.sent
        assert link is not None
        link.send(wire.Kind.DONE, room, meta, after=lambda: self._start_ack_clock(room))
        return True

    def abort(self, room: int, reason: str = "aborted") -> None:
        """End the room now, in any state (poll() will not report it); the decode side is told."""
        with self._lock:
            self._check_open()
            self._aborted[room] = (self._now() + self.config.bootstrap_timeout, reason)
            self._events = [e for e in self._events if e.room != room]
            rec = self._rooms.pop(room, None)
            if rec is not None and rec.link is not None and rec.state not in ENDED:
                rec.link.send(wire.Kind.ABORT, room, {"reason": reason})

    def poll(self) -> list[RoomEvent]:
        """What happened since the last poll: READY, DONE and FAILED rooms, in order."""
        with self._lock:
            events, self._events = self._events, []
            for e in events:
                if e.kind != EventKind.READY:
                    self._rooms.pop(e.room, None)
            self._stats = count_ends(self._stats, events)
            return events

    def state(self, room: int) -> Optional[PrefillState]:
        """The room's state, None for a room this side does not hold (never expected, or ended and polled)."""
        with self._lock:
            rec = self._rooms.get(room)
            return rec.state if rec is not None and rec.claimed else None

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        """Stop serving: the connections close (the decode side fails its rooms); nothing is reported after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._net.call(self._server.close)
        self._net.call(self._close_links)
        self._net.stop()

    def _close_links(self) -> None:
        for link in list(self._links):
            link.lose("was closed by the prefill worker")

    def __enter__(self) -> PrefillTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers (the caller's thread holds the lock where they need it) -----------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV transfer endpoint is closed")

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _live(self, room: int) -> Optional[_Room]:
        rec = self._rooms.get(room)
        return rec if rec is not None and rec.claimed and rec.state not in ENDED else None

    def _gather(self, pages: list[int]) -> memoryview:
        idx = torch.tensor(pages, dtype=torch.int32, device=self._kv.device)
        buf = ops.gather_kv_pages(self._kv, idx, backend=self._backend)
        buf = buf.cpu()  # a no-op on the CPU; from the GPU, the bytes to send
        return buf.view(torch.uint8).reshape(-1).numpy().data

    def _end(self, rec: _Room, kind: EventKind, error: Optional[str] = None) -> None:
        rec.state = PrefillState.DONE if kind == EventKind.DONE else PrefillState.FAILED
        rec.deadline, rec.error = math.inf, error
        if not rec.claimed:  # the caller does not know it yet: expect() reports it
            rec.deadline = self._now() + self.config.bootstrap_timeout
            return
        self._events.append(RoomEvent(rec.room, kind, pages=rec.sent, error=error))

    # -- the network thread ----------------------------------------------------------------------------

    def _start_ack_clock(self, room: int) -> None:
        with self._lock:
            rec = self._rooms.get(room)
            if rec is not None and rec.state == PrefillState.AWAITING_ACK:
                rec.deadline = self._now() + self.config.ack_timeout

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = Link(self._net, reader, writer, self.config.send_timeout, self._lost)
        with self._lock:
            self._links.add(link)
        cfg = self.config
        try:
            hello = await asyncio.wait_for(wire.read_frame(reader, cfg.max_meta_bytes, 0), cfg.connect_timeout)
            rejected = self._hello(link, hello)
            while True:
                frame = await wire.read_frame(reader, cfg.max_meta_bytes, 0)
                with self._lock:
                    self._on_frame(link, frame, rejected)
        except asyncio.TimeoutError:
            link.lose(f"said no hello within {cfg.connect_timeout:g} s")
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            link.lose("closed the connection")
        except wire.ProtocolError as exc:
            log.error("kv transfer: decode worker %s: %s", link.name, exc)
            link.lose(f"broke the protocol: {exc}")
        except asyncio.CancelledError:  # the endpoint is closing (asyncio's server would log it as an error)
            link.lose("was closed by the prefill worker")

    def _hello(self, link: Link, frame: wire.Frame) -> Optional[str]:
        """Answer the decode side's hello; the error when its layout or version differs (None: accepted)."""
        if frame.kind != wire.Kind.HELLO:
            raise wire.ProtocolError(f"the first frame is {frame.kind.name}, not HELLO")
        error: Optional[str] = None
        version = frame.meta.get("version")
        if version != wire.VERSION:
            error = f"KV transfer protocol version {version!r} (decode) != {wire.VERSION} (prefill)"
        else:
            try:
                theirs = KVLayout.from_wire(frame.meta.get("layout"))
            except (TypeError, ValueError) as exc:
                raise wire.ProtocolError(f"HELLO: {exc}") from None
            if theirs != self.layout:
                error = str(KVLayoutMismatch(self.layout, theirs, f"{self.host}:{self.port}"))
            link.peer_max_frame_bytes = wire.checked(frame.meta, "max_frame_bytes", int, frame.kind)
        if error is not None:
            log.error("kv transfer: decode worker %s refused: %s", link.name, error)
            link.send(wire.Kind.HELLO_ERR, 0, {"error": error, "layout": self.layout.to_wire()})
        else:
            link.send(wire.Kind.HELLO_OK, 0, {"version": wire.VERSION, "layout": self.layout.to_wire()})
        return error

    def _on_frame(self, link: Link, frame: wire.Frame, rejected: Optional[str]) -> None:
        room, kind, now = frame.room, frame.kind, self._now()
        rec = self._rooms.get(room)
        if kind == wire.Kind.ANNOUNCE:
            pages = wire.checked(frame.meta, "pages", int, kind)
            skip = wire.checked(frame.meta, "skip_pages", int, kind)
            if rejected is not None or room in self._aborted:
                reason = rejected if rejected is not None else self._aborted[room][1]
                link.send(wire.Kind.ABORT, room, {"reason": reason})
            elif rec is None:  # before the request: held for bootstrap_timeout
                self._rooms[room] = _Room(
                    room, PrefillState.READY, now + self.config.bootstrap_timeout, False, link, pages, skip
                )
            elif rec.claimed and rec.state == PrefillState.BOOTSTRAPPING:
                rec.state, rec.deadline, rec.link, rec.pages, rec.skip_pages = (
                    PrefillState.READY,
                    math.inf,
                    link,
                    pages,
                    skip,
                )
                self._events.append(RoomEvent(room, EventKind.READY, pages=pages, skip_pages=skip))
            else:
                link.send(wire.Kind.ABORT, room, {"reason": "the room was announced twice"})
        elif kind in (wire.Kind.REFUSE, wire.Kind.ABORT):
            said = str(frame.meta.get("reason", ""))
            if kind == wire.Kind.REFUSE:
                reason = f"the decode worker could not reserve KV pages for it: {said}"
            else:
                reason = f"aborted by the decode side: {said}"
            if room in self._aborted:
                return
            if rec is None:  # before the request: expect() will report it
                rec = self._rooms[room] = _Room(room, PrefillState.BOOTSTRAPPING, 0.0, False)
            if rec.state not in ENDED and (rec.link is None or rec.link is link):
                rec.link = link
                self._end(rec, EventKind.FAILED, reason)
        elif kind == wire.Kind.ACK:
            if rec is not None and rec.link is link and rec.state == PrefillState.AWAITING_ACK:
                self._end(rec, EventKind.DONE)
        else:
            raise wire.ProtocolError(f"a decode worker does not send {kind.name}")

    def _lost(self, link: Link, reason: str) -> None:
        with self._lock:
            self._links.discard(link)
            for rec in self._rooms.values():
                if rec.link is link and rec.state not in ENDED:
                    self._end(rec, EventKind.FAILED, f"the decode worker at {link.name} {reason}")

    async def _watch(self) -> None:
        """Every tick: end the rooms whose wait ran out."""
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.tick)
            with self._lock:
                now = self._now()
                for room, (until, _) in list(self._aborted.items()):
                    if until <= now:
                        del self._aborted[room]
                for rec in list(self._rooms.values()):
                    if rec.deadline > now:
                        continue
                    if not rec.claimed:  # the request never came: forget it, tell the decode side
                        del self._rooms[rec.room]
                        if rec.link is not None and rec.state not in ENDED:
                            reason = f"the prefill worker did not get this request within {cfg.bootstrap_timeout:g} s"
                            rec.link.send(wire.Kind.ABORT, rec.room, {"reason": reason})
                    elif rec.state == PrefillState.BOOTSTRAPPING:
                        why = f"the decode side did not announce it within {cfg.bootstrap_timeout:g} s (bootstrap_timeout)"
                        self._end(rec, EventKind.FAILED, why)
                    elif rec.state == PrefillState.AWAITING_ACK:
                        why = f"the decode worker did not confirm the pages within {cfg.ack_timeout:g} s (ack_timeout)"
                        self._end(rec, EventKind.FAILED, why)
                        if rec.link is not None:
                            rec.link.send(wire.Kind.ABORT, rec.room, {"reason": why})
