"""`DecodeTransfer`: the decode worker's end. It connects to each prefill worker's bootstrap server
(one connection per prefill worker, shared by its rooms), announces the pages it reserved for a room,
and puts the pages that arrive into its own pool.

    xfer = DecodeTransfer(kv_cache, "smollm2")
    xfer.expect(room, host, port, pages)   # pages reserved for the room's KV (the router's bootstrap_*)
    xfer.refuse(room, host, port, "no free pages")   # could not reserve: the prefill side drops it
    for ev in xfer.poll():                 # every step of the engine loop: page batches land in the pool
        DONE   -> the room's KV is in `pages`; ev.metadata: the prefill side's (first token, ...)
        FAILED -> abort the request and free its pages (ev.error); the prefill side has been told
    xfer.abort(room, "client went away")   # any state; the prefill side is told

Received batches wait in memory (bounded by the room's reserved pages) until `poll()` scatters them
(`ops.scatter_kv_pages`) on the caller's thread, so the pool is only ever written by its owner's
thread, between steps. A room whose every page has arrived does not need its prefill worker any more:
that worker dying then does not fail it. Call the methods from one thread.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import torch

from minisched import ops
from minisched.engine.kv_transfer import wire
from minisched.engine.kv_transfer.config import TransferConfig
from minisched.engine.kv_transfer.layout import KVLayout, KVLayoutMismatch
from minisched.engine.kv_transfer.link import Link, LoopThread
from minisched.engine.kv_transfer.rooms import DecodeState, EventKind, RoomEvent, TransferStats, count_ends

log = logging.getLogger("minisched.kv_transfer")
ENDED = (DecodeState.DONE, DecodeState.FAILED)
NEEDS_PEER = (DecodeState.CONNECTING, DecodeState.WAITING, DecodeState.RECEIVING)


@dataclass
class _Peer:
    """One prefill worker: its connection once the handshake is done, and what waits for it."""

    host: str
    port: int
    link: Optional[Link] = None
    lost: bool = False
    queued: list[tuple[wire.Kind, int, str]] = field(default_factory=list)  # REFUSE / ABORT before the link

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class _Room:
    room: int
    state: DecodeState
    deadline: float
    peer: _Peer
    dst: list[int]
    skip_pages: int
    received: int = 0
    applied: int = 0
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (start, pages) for poll()
    metadata: Optional[dict[str, Any]] = None


def close_all(links: list[Link], reason: str) -> None:
    for link in links:
        link.lose(reason)


class DecodeTransfer:
    def __init__(
        self,
        kv_cache: torch.Tensor,
        model: str,
        *,
        config: TransferConfig = TransferConfig(),
        backend: ops.Backend = "native",
    ):
        self.layout = KVLayout.of(kv_cache, model)
        self.config = config
        self._kv, self._backend = kv_cache, backend
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._peers: dict[tuple[str, int], _Peer] = {}
        self._events: list[RoomEvent] = []
        self._stats = TransferStats()
        self._closed = False
        self._net = LoopThread("kv-transfer-decode")
        self._net.submit(self._watch())

    # -- the caller's side (one thread) --------------------------------------------------------------

    def expect(self, room: int, host: str, port: int, pages: Sequence[int], skip_pages: int = 0) -> None:
        """`pages` (pool page ids) are reserved for the room's KV past its first skip_pages pages:
        announce them to the prefill worker at host:port (its bootstrap port)."""
        dst = [int(p) for p in pages]
        num_pages = self._kv.shape[2]
        if len(set(dst)) != len(dst) or any(not 0 <= p < num_pages for p in dst):
            raise ValueError(f"room {room}: pages must be distinct pool pages in [0, {num_pages}), got {dst}")
        if skip_pages < 0:
            raise ValueError(f"room {room}: skip_pages must be >= 0, got {skip_pages}")
        with self._lock:
            self._check_open()
            if room in self._rooms:
                raise ValueError(f"room {room} is expected already")
            peer = self._peer(host, port)
            rec = _Room(room, DecodeState.CONNECTING, self._now() + self.config.connect_timeout, peer, dst, skip_pages)
            self._rooms[room] = rec
            if peer.link is not None:
                self._announce(rec, peer.link)

    def refuse(self, room: int, host: str, port: int, reason: str) -> None:
        """No pages for the room: tell the prefill worker at host:port, which drops it."""
        with self._lock:
            self._check_open()
            if room in self._rooms:
                raise ValueError(f"room {room} is expected here: abort() it instead")
            self._send_or_queue(self._peer(host, port), wire.Kind.REFUSE, room, reason)

    def abort(self, room: int, reason: str = "aborted") -> None:
        """End the room now, in any state (poll() will not report it); the prefill side is told.
        Its pages are the caller's again as soon as this returns: nothing writes them after."""
        with self._lock:
            self._check_open()
            self._events = [e for e in self._events if e.room != room]
            rec = self._rooms.pop(room, None)
            if rec is not None and rec.state not in ENDED:
                self._send_or_queue(rec.peer, wire.Kind.ABORT, room, reason)

    def poll(self) -> list[RoomEvent]:
        """Put the page batches that arrived into the pool, then report the rooms that ended (DONE: all
        of its pages are in the pool; FAILED), in order."""
        with self._lock:
            work = [(rec, rec.chunks) for rec in self._rooms.values() if rec.chunks]
            for rec, _ in work:
                rec.chunks = []
        for rec, chunks in work:
            for start, src in chunks:
                idx = torch.tensor(rec.dst[start : start + src.shape[2]], dtype=torch.int32, device=self._kv.device)
                ops.scatter_kv_pages(src.to(self._kv.device), self._kv, idx, backend=self._backend)
                rec.applied += src.shape[2]
        with self._lock:
            for rec in self._rooms.values():
                if rec.state == DecodeState.RECEIVED and not rec.chunks and rec.applied == rec.received:
                    self._end(rec, EventKind.DONE, metadata=rec.metadata)
                    if rec.peer.link is not None:
                        rec.peer.link.send(wire.Kind.ACK, rec.room)
            events, self._events = self._events, []
            for e in events:
                self._rooms.pop(e.room, None)
            self._stats = count_ends(self._stats, events)
            return events

    def state(self, room: int) -> Optional[DecodeState]:
        with self._lock:
            rec = self._rooms.get(room)
            return rec.state if rec is not None else None

    def stats(self) -> TransferStats:
        with self._lock:
            return self._stats

    def close(self) -> None:
        """Close every connection (the prefill side fails its rooms); nothing is reported after."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links = [p.link for p in self._peers.values() if p.link is not None]
        self._net.call(lambda: close_all(links, "was closed by the decode worker"))
        self._net.stop()

    def __enter__(self) -> DecodeTransfer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- helpers (called with the lock held) -----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the KV transfer endpoint is closed")

    @staticmethod
    def _now() -> float:
        return time.monotonic()

    def _peer(self, host: str, port: int) -> _Peer:
        """The prefill worker's peer: connected, connecting, or (none yet, or the last one lost) new."""
        peer = self._peers.get((host, port))
        if peer is None or peer.lost:
            peer = self._peers[(host, port)] = _Peer(host, port)
            self._net.submit(self._connect(peer))
        return peer

    def _announce(self, rec: _Room, link: Link) -> None:
        rec.state, rec.deadline = DecodeState.WAITING, self._now() + self.config.transfer_timeout
        link.send(wire.Kind.ANNOUNCE, rec.room, {"pages": len(rec.dst), "skip_pages": rec.skip_pages})

    def _send_or_queue(self, peer: _Peer, kind: wire.Kind, room: int, reason: str) -> None:
        if peer.link is not None:
            peer.link.send(kind, room, {"reason": reason})
        elif not peer.lost:
            peer.queued.append((kind, room, reason))

    def _end(
        self, rec: _Room, kind: EventKind, error: Optional[str] = None, metadata: Optional[dict[str, Any]] = None
    ) -> None:
        rec.state = DecodeState.DONE if kind == EventKind.DONE else DecodeState.FAILED
        rec.deadline, rec.chunks = math.inf, []
        self._events.append(RoomEvent(rec.room, kind, pages=rec.received, metadata=metadata, error=error))

    def _fail(self, rec: _Room, error: str, tell_peer: bool) -> None:
        self._end(rec, EventKind.FAILED, error)
        if tell_peer and rec.peer.link is not None:
            rec.peer.link.send(wire.Kind.ABORT, rec.room, {"reason": error})

    # -- the network thread ----------------------------------------------------------------------------

    async def _connect(self, peer: _Peer) -> None:
        cfg = self.config
        link: Optional[Link] = None
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(peer.host, peer.port, limit=wire.STREAM_LIMIT), cfg.connect_timeout
            )
            link = Link(self._net, reader, writer, cfg.send_timeout, lambda lk, why: self._lost(peer, why))
            hello = {"version": wire.VERSION, "layout": self.layout.to_wire(), "max_frame_bytes": cfg.max_frame_bytes}
            link.send(wire.Kind.HELLO, 0, hello)
            reply = await asyncio.wait_for(wire.read_frame(reader, cfg.max_meta_bytes, 0), cfg.connect_timeout)
            error = self._check_hello(peer, reply)
            if error is not None:
                self._refused(peer, link, error)
                return
            with self._lock:
                peer.link = link
                for kind, room, reason in peer.queued:
                    link.send(kind, room, {"reason": reason})
                peer.queued.clear()
                for rec in self._rooms.values():
                    if rec.peer is peer and rec.state == DecodeState.CONNECTING:
                        self._announce(rec, link)
        except asyncio.TimeoutError:
            self._lost(peer, f"did not answer within {cfg.connect_timeout:g} s (connect_timeout)", link)
            return
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            self._lost(peer, f"refused the connection or closed it at once ({exc or type(exc).__name__})", link)
            return
        except wire.ProtocolError as exc:
            log.error("kv transfer: prefill worker %s: %s", peer.addr, exc)
            self._lost(peer, f"broke the protocol: {exc}", link)
            return
        assert link is not None
        try:
            await self._read(peer, link)
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self._lost(peer, "closed the connection", link)
        except wire.ProtocolError as exc:
            log.error("kv transfer: prefill worker %s: %s", peer.addr, exc)
            self._lost(peer, f"broke the protocol: {exc}", link)

    def _check_hello(self, peer: _Peer, reply: wire.Frame) -> Optional[str]:
        """The prefill side's refusal (or this side's, should its layout differ after all); None: accepted."""
        if reply.kind == wire.Kind.HELLO_ERR:
            return str(reply.meta.get("error", "refused"))
        if reply.kind != wire.Kind.HELLO_OK:
            raise wire.ProtocolError(f"the answer to HELLO is {reply.kind.name}")
        if reply.meta.get("version") != wire.VERSION:
            return f"KV transfer protocol version {wire.VERSION} (decode) != {reply.meta.get('version')!r} (prefill)"
        try:
            theirs = KVLayout.from_wire(reply.meta.get("layout"))
        except (TypeError, ValueError) as exc:
            raise wire.ProtocolError(f"HELLO_OK: {exc}") from None
        return None if theirs == self.layout else str(KVLayoutMismatch(theirs, self.layout, peer.addr))

    def _refused(self, peer: _Peer, link: Link, error: str) -> None:
        """The handshake failed: every room waiting for this worker fails with the error, and the prefill
        side hears of each (it may hold them already); then the link closes."""
        log.error("kv transfer: prefill worker %s: %s", peer.addr, error)
        with self._lock:
            peer.lost = True
            for kind, room, reason in peer.queued:
                link.send(kind, room, {"reason": reason})
            peer.queued.clear()
            for rec in self._rooms.values():
                if rec.peer is peer and rec.state in NEEDS_PEER:
                    self._end(rec, EventKind.FAILED, error)
                    link.send(wire.Kind.ABORT, rec.room, {"reason": error})
        link.close_after_sends()

    async def _read(self, peer: _Peer, link: Link) -> None:
        cfg, bpp = self.config, self.layout.bytes_per_page
        while True:
            frame = await wire.read_frame(link.reader, cfg.max_meta_bytes, max(cfg.max_frame_bytes, bpp))
            room, kind = frame.room, frame.kind
            if kind == wire.Kind.PAGES:
                start = wire.checked(frame.meta, "start", int, kind)
                n = wire.checked(frame.meta, "n", int, kind)
                if n < 1 or frame.payload_len != n * bpp:
                    raise wire.ProtocolError(f"PAGES frame: {frame.payload_len} bytes for {n} pages of {bpp}")
                payload = await wire.read_payload(link.reader, frame.payload_len)
                pages = torch.frombuffer(payload, dtype=self.layout.torch_dtype)
                shape = self.layout.page_shape
                pages = pages.view(shape[0], shape[1], n, *shape[2:])
            with self._lock:
                rec = self._rooms.get(room)
                if rec is None or rec.peer is not peer or rec.state in ENDED:
                    continue  # a room this side ended meanwhile (an abort is on its way): dropped
                if kind == wire.Kind.PAGES:
                    self._on_pages(rec, start, pages)
                elif kind == wire.Kind.DONE:
                    self._on_done(rec, frame)
                elif kind == wire.Kind.ABORT:
                    self._end(rec, EventKind.FAILED, f"aborted by the prefill side: {frame.meta.get('reason', '')}")
                else:
                    raise wire.ProtocolError(f"a prefill worker does not send {kind.name} after the handshake")

    def _on_pages(self, rec: _Room, start: int, pages: torch.Tensor) -> None:
        n = pages.shape[2]
        if rec.state not in (DecodeState.WAITING, DecodeState.RECEIVING):
            self._fail(rec, f"pages came after the done frame (room {rec.room})", True)
        elif start != rec.received or start + n > len(rec.dst):
            why = f"pages {start}..{start + n} do not follow the {rec.received} received of {len(rec.dst)} reserved"
            self._fail(rec, why, True)
        else:
            rec.chunks.append((start, pages))
            rec.received += n
            rec.state, rec.deadline = DecodeState.RECEIVING, self._now() + self.config.transfer_timeout
            self._stats = replace(
                self._stats,
                pages=self._stats.pages + n,
                bytes=self._stats.bytes + n * self.layout.bytes_per_page,
                frames=self._stats.frames + 1,
            )

    def _on_done(self, rec: _Room, frame: wire.Frame) -> None:
        sent = wire.checked(frame.meta, "pages", int, frame.kind)
        metadata = frame.meta.get("metadata")
        if sent != rec.received or not isinstance(metadata, dict):
            self._fail(rec, f"the done frame says {sent} pages, {rec.received} came", True)
        else:
            rec.state, rec.deadline, rec.metadata = DecodeState.RECEIVED, math.inf, metadata

    def _lost(self, peer: _Peer, reason: str, link: Optional[Link] = None) -> None:
        """The prefill worker is gone (or never came): every room still waiting on it fails."""
        if link is not None:
            link.lose(reason)  # closes the socket; its on_lost comes back here once, with no link
            return
        with self._lock:
            peer.lost, peer.link = True, None
            peer.queued.clear()
            for rec in self._rooms.values():
                if rec.peer is peer and rec.state in NEEDS_PEER:
                    self._end(rec, EventKind.FAILED, f"the prefill worker at {peer.addr} {reason}")

    async def _watch(self) -> None:
        cfg = self.config
        while True:
            await asyncio.sleep(cfg.tick)
            with self._lock:
                now = self._now()
                for rec in self._rooms.values():
                    if rec.deadline > now or rec.state in ENDED:
                        continue
                    if rec.state == DecodeState.CONNECTING:
                        why = f"no connection to the prefill worker at {rec.peer.addr} within {cfg.connect_timeout:g} s"
                        self._fail(rec, why, False)
                        rec.peer.queued.append((wire.Kind.ABORT, rec.room, why))
                    else:
                        why = f"no KV from the prefill worker at {rec.peer.addr} for {cfg.transfer_timeout:g} s (transfer_timeout)"
                        self._fail(rec, why, True)
