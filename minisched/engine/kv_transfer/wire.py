"""The transfer's frames on a TCP stream: a fixed header, a JSON part, raw bytes.

    header  !4sBQIQ   magic b"MSKV", kind (Kind), room (u64), JSON length (u32), payload length (u64)
    meta    JSON object (utf-8)
    payload raw bytes (PAGES: the gathered pages [L, 2, n, page_size, Hkv, D], C order, the pool's dtype)

One connection per (decode worker, prefill worker) pair carries every room between them. The decode
side opens it and says HELLO; the prefill side answers HELLO_OK or HELLO_ERR (KV layouts differ, another
protocol version) and every later frame names its room. Who sends what:

    decode -> prefill   HELLO {version, layout, max_frame_bytes}
                        ANNOUNCE room {pages, skip_pages}   pages reserved for the room's KV
                        REFUSE room {reason}                 could not reserve: do not compute for nobody
                        ACK room {}                          the pages are in the decode side's pool
    prefill -> decode   HELLO_OK {version, layout} / HELLO_ERR {error, layout}
                        PAGES room {start, n} + payload      the next n pages, from page `start`
                        DONE room {pages, metadata}          all pages sent; metadata for the decode side
    both                ABORT room {reason}
"""

from __future__ import annotations

import asyncio
import enum
import json
import struct
from dataclasses import dataclass
from typing import Any

VERSION = 1
MAGIC = b"MSKV"
HEADER = struct.Struct("!4sBQIQ")
# the stream reader's buffer limit: asyncio pauses reading at twice this; its 64 KiB default made a
# page batch of megabytes arrive in hundreds of pause/resume turns of the loop
STREAM_LIMIT = 4 << 20


class Kind(enum.IntEnum):
    HELLO = 1
    HELLO_OK = 2
    HELLO_ERR = 3
    ANNOUNCE = 4
    REFUSE = 5
    PAGES = 6
    DONE = 7
    ACK = 8
    ABORT = 9


class ProtocolError(RuntimeError):
    """The peer sent something that is not a frame of this protocol, or one over the limits: the
    connection cannot be read on (its rooms fail)."""


@dataclass(frozen=True)
class Frame:
    kind: Kind
    room: int
    meta: dict[str, Any]
    payload_len: int


def encode(kind: Kind, room: int = 0, meta: dict[str, Any] | None = None, payload_len: int = 0) -> bytes:
    """Header + JSON part of one frame (its payload, if any, is written right after)."""
    body = json.dumps(meta or {}, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, int(kind), room, len(body), payload_len) + body


async def read_frame(reader: asyncio.StreamReader, max_meta_bytes: int, max_payload_bytes: int) -> Frame:
    """The next frame's header and JSON part; the caller reads (or skips) its payload_len bytes next.
    asyncio.IncompleteReadError when the stream ends; ProtocolError for anything malformed."""
    magic, kind, room, meta_len, payload_len = HEADER.unpack(await reader.readexactly(HEADER.size))
    if magic != MAGIC:
        raise ProtocolError(f"not a KV transfer frame (magic {magic!r})")
    try:
        k = Kind(kind)
    except ValueError:
        raise ProtocolError(f"unknown frame kind {kind}") from None
    if meta_len > max_meta_bytes:
        raise ProtocolError(f"{k.name} frame: JSON part of {meta_len} bytes > the limit {max_meta_bytes}")
    if payload_len > (max_payload_bytes if k == Kind.PAGES else 0):
        raise ProtocolError(f"{k.name} frame: payload of {payload_len} bytes > the limit")
    try:
        meta = json.loads(await reader.readexactly(meta_len)) if meta_len else {}
    except ValueError:
        raise ProtocolError(f"{k.name} frame: its JSON part does not parse") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"{k.name} frame: its JSON part is not an object")
    return Frame(k, room, meta, payload_len)


async def read_payload(reader: asyncio.StreamReader, n: int) -> bytearray:
    """n bytes into one writable buffer (torch.frombuffer takes it without a copy)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        chunk = await reader.read(min(n - got, STREAM_LIMIT))
        if not chunk:
            raise asyncio.IncompleteReadError(bytes(view[:got]), n)
        view[got : got + len(chunk)] = chunk
        got += len(chunk)
    return buf


def checked(meta: dict[str, Any], name: str, kind: type, frame: Kind) -> Any:
    """meta[name] checked to be a `kind` (ints: >= 0, not bool); ProtocolError otherwise."""
    value = meta.get(name)
    if kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    else:
        ok = isinstance(value, kind)
    if not ok:
        raise ProtocolError(f"{frame.name} frame: {name}={value!r} is not a valid {kind.__name__}")
    return value
