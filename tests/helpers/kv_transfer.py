"""Helpers for the KV transfer tests (tests/engine/test_kv_transfer.py): random pools, a page
allocator that catches a double free, polling with a deadline, a hand-played peer over a raw
socket, and a peer in a subprocess (tests/helpers/kv_peer.py) to kill.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from minisched.engine.kv_transfer import EventKind, RoomEvent, wire

HOST = "127.0.0.1"


def random_pool(
    num_pages: int, page_size: int, dtype: torch.dtype, seed: int, layers: int = 3, heads: int = 2, dim: int = 8
):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layers, 2, num_pages, page_size, heads, dim, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: equality is bit-exactness (NaNs and -0.0 included)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


@dataclass
class PagePool:
    """Which pages each room holds; giving a room's pages back twice is an error."""

    num_pages: int
    free: set[int] = field(default_factory=set)
    held: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = set(range(self.num_pages))

    def reserve(self, room: int, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(seed + room)
        free = sorted(self.free)
        pages = [free[i] for i in torch.randperm(len(free), generator=g)[:n].tolist()]  # scattered, out of order
        self.free -= set(pages)
        self.held[room] = pages
        return pages

    def release(self, room: int) -> None:
        assert room in self.held, f"room {room}: pages given back twice (or never taken)"
        self.free |= set(self.held.pop(room))

    @property
    def clean(self) -> bool:
        return not self.held and len(self.free) == self.num_pages


# events polled while waiting for another room's, kept for whoever waits for theirs
_BACKLOG: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def poll_until(endpoint, room: int, timeout: float = 10.0, pool: Optional[PagePool] = None) -> RoomEvent:
    """Poll until an event of `room` comes (returned; other rooms' events wait for their turn). A room's
    end gives its pages back to `pool` when one is given, as a scheduler would."""
    backlog = _BACKLOG.setdefault(endpoint, [])
    deadline = time.monotonic() + timeout
    while True:
        for i, ev in enumerate(backlog):
            if ev.room == room:
                del backlog[i]
                if pool is not None and ev.kind != EventKind.READY:
                    pool.release(ev.room)
                return ev
        if time.monotonic() > deadline:
            raise AssertionError(f"no event for room {room} in {timeout} s (state {endpoint.state(room)})")
        backlog += endpoint.poll()
        time.sleep(0.005)


def quiet_for(endpoint, seconds: float) -> list[RoomEvent]:
    """Everything the endpoint reports in `seconds` (expected: nothing)."""
    got: list[RoomEvent] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got += endpoint.poll()
        time.sleep(0.01)
    return got


def wait_state(endpoint, room: int, state, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while endpoint.state(room) != state:
        assert time.monotonic() < deadline, f"room {room} is {endpoint.state(room)}, not {state}, after {timeout} s"
        time.sleep(0.005)


# -- a peer played by hand ----------------------------------------------------------------------------


class RawConn:
    """One end of a transfer connection driven frame by frame from the test."""

    def __init__(self, sock: socket.socket):
        self.sock = sock

    def send(self, kind: wire.Kind, room: int = 0, meta: Optional[dict[str, Any]] = None, payload: bytes = b"") -> None:
        self.sock.sendall(wire.encode(kind, room, meta, len(payload)) + payload)

    def _read(self, n: int, timeout: float) -> bytes:
        out = b""
        self.sock.settimeout(timeout)
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise EOFError("the peer closed the connection")
            out += chunk
        return out

    def recv(self, timeout: float = 5.0) -> tuple[wire.Kind, int, dict[str, Any], bytes]:
        magic, kind, room, meta_len, payload_len = wire.HEADER.unpack(self._read(wire.HEADER.size, timeout))
        assert magic == wire.MAGIC
        meta = json.loads(self._read(meta_len, timeout)) if meta_len else {}
        return wire.Kind(kind), room, meta, self._read(payload_len, timeout) if payload_len else b""

    def closed_by_peer(self, timeout: float) -> bool:
        """True when the peer closes within `timeout` (whatever it sent before is skipped)."""
        self.sock.settimeout(timeout)
        try:
            while self.sock.recv(1 << 16):
                pass
            return True
        except TimeoutError:
            return False
        except ConnectionError:
            return True

    def close(self) -> None:
        self.sock.close()


class RawListener:
    """A bootstrap port that accepts connections and answers only what the test sends."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind((HOST, 0))
        self.sock.listen(8)
        self.port = self.sock.getsockname()[1]

    def accept(self, timeout: float = 5.0) -> RawConn:
        self.sock.settimeout(timeout)
        conn, _ = self.sock.accept()
        return RawConn(conn)

    def close(self) -> None:
        self.sock.close()


def raw_connect(port: int, rcvbuf: Optional[int] = None) -> RawConn:
    sock = socket.socket()
    if rcvbuf is not None:  # before connect: the window the peer may fill
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((HOST, port))
    return RawConn(sock)


def hello(layout, max_frame_bytes: int = 1 << 20) -> dict[str, Any]:
    return {"version": wire.VERSION, "layout": layout.to_wire(), "max_frame_bytes": max_frame_bytes}


# -- a peer in a subprocess -----------------------------------------------------------------------------

PEER_SCRIPT = Path(__file__).with_name("kv_peer.py")


class PeerProcess:
    """tests/helpers/kv_peer.py in a session of its own; `line(prefix)` waits for its next such line."""

    def __init__(self, *args: str):
        # -I: the script's folder (tests/helpers/) stays off sys.path
        argv = [sys.executable, "-I", str(PEER_SCRIPT), *args]
        self.popen = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        self.output: list[str] = []

    def line(self, prefix: str, timeout: float = 120.0) -> str:
        assert self.popen.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.popen.stdout], [], [], 0.1)
            if ready:
                raw = self.popen.stdout.readline()
                if not raw:
                    break
                text = raw.decode().rstrip("\n")
                self.output.append(text)
                if text.startswith(prefix):
                    return text[len(prefix) :].strip()
        raise AssertionError(f"no line {prefix!r} from the peer process; it wrote: {self.output}")

    def kill(self) -> None:
        if self.popen.poll() is None:
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
