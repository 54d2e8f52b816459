"""KV transfer between a prefill and a decode endpoint on loopback (minisched/engine/kv_transfer/).

Pages are bit-exact after the trip (page sizes 1 and 16, fp32 and bf16, several layers, rooms
interleaved on one connection and across two prefill workers); a layout mismatch fails both sides'
rooms with an error naming both sides' values; a decode side without pages refuses; an abort from
either side at every state ends the room on both; a peer process killed mid-transfer ends its rooms
with an error; every wait times out. Each side gives a room's pages back exactly once (PagePool
raises on a second time) and ends with its pool clean.
"""

from __future__ import annotations

import dataclasses
import socket

import pytest
import torch

from helpers.kv_transfer import (
    HOST,
    PagePool,
    PeerProcess,
    RawListener,
    bits,
    hello,
    poll_until,
    quiet_for,
    random_pool,
    raw_connect,
    wait_state,
)
from minisched.engine.kv_transfer import (
    DecodeState,
    DecodeTransfer,
    EventKind,
    KVLayout,
    PrefillState,
    PrefillTransfer,
    TransferConfig,
    wire,
)

pytestmark = pytest.mark.timeout(60)
FAST = TransferConfig(bootstrap_timeout=5, transfer_timeout=5, ack_timeout=5, connect_timeout=5, send_timeout=5)
NUM_PAGES = 48


@pytest.fixture
def ends(request):
    """A prefill and a decode endpoint (page size 16, fp32 unless parametrized), closed after the test."""
    page_size, dtype, config = getattr(request, "param", (16, torch.float32, FAST))
    src = random_pool(NUM_PAGES, page_size, dtype, seed=1)
    dst = random_pool(NUM_PAGES, page_size, dtype, seed=2)
    p, d = PrefillTransfer(src, "m", config=config), DecodeTransfer(dst, "m", config=config)
    yield p, d, src, dst
    p.close()
    d.close()


def handshake(p, d, p_pool, d_pool, room, n, skip=0):
    """The router's two halves of one request: the prefill side expects the room, the decode side
    reserves n pages and announces them; returns (prefill pages, decode pages) once READY."""
    src_pages = p_pool.reserve(room, n + skip, seed=10)
    dst_pages = d_pool.reserve(room, n, seed=20)
    p.expect(room)
    d.expect(room, HOST, p.port, dst_pages, skip_pages=skip)
    ev = poll_until(p, room)
    assert (ev.kind, ev.pages, ev.skip_pages) == (EventKind.READY, n, skip)
    return src_pages[skip:], dst_pages


@pytest.mark.parametrize(
    "ends",
    [(1, torch.float32, FAST), (16, torch.float32, FAST), (1, torch.bfloat16, FAST), (16, torch.bfloat16, FAST)],
    indirect=True,
    ids=["page1-fp32", "page16-fp32", "page1-bf16", "page16-bf16"],
)
def test_pages_arrive_bit_exact(ends):
    p, d, src, dst = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    before = dst.clone()
    src_pages, dst_pages = handshake(p, d, p_pool, d_pool, room=41, n=10)
    # as prefill chunks finish: 4 pages, then 3, then 3, the decode side applying what came in between
    for lo, hi in ((0, 4), (4, 7), (7, 10)):
        assert p.send_pages(41, src_pages[lo:hi])
        assert d.poll() == []
    assert p.finish(41, {"first_token": 123, "input_token_logprobs": [[-0.5, 7, None]]})
    ev = poll_until(d, 41, pool=d_pool)
    assert (ev.kind, ev.pages) == (EventKind.DONE, 10)
    assert ev.metadata == {"first_token": 123, "input_token_logprobs": [[-0.5, 7, None]]}
    assert torch.equal(bits(dst[:, :, dst_pages]), bits(src[:, :, src_pages]))
    untouched = sorted(set(range(NUM_PAGES)) - set(dst_pages))
    assert torch.equal(bits(dst[:, :, untouched]), bits(before[:, :, untouched]))
    assert poll_until(p, 41, pool=p_pool).kind == EventKind.DONE
    assert p_pool.clean and d_pool.clean
    layout = p.layout
    for stats in (p.stats(), d.stats()):
        assert (stats.pages, stats.bytes, stats.rooms_done) == (10, 10 * layout.bytes_per_page, 1)
    assert p.state(41) is None and d.state(41) is None  # ended and reported: forgotten


def test_a_batch_larger_than_a_frame_is_split():
    """The decode side's max_frame_bytes (said at hello) bounds every page batch the prefill side sends."""
    src, dst = random_pool(NUM_PAGES, 16, torch.float32, 1), random_pool(NUM_PAGES, 16, torch.float32, 2)
    bpp = KVLayout.of(src, "m").bytes_per_page
    with (
        PrefillTransfer(src, "m", config=FAST) as p,
        DecodeTransfer(dst, "m", config=TransferConfig(max_frame_bytes=3 * bpp)) as d,
    ):
        p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
        src_pages, dst_pages = handshake(p, d, p_pool, d_pool, room=5, n=10)
        p.send_pages(5, src_pages)
        p.finish(5)
        assert poll_until(d, 5, pool=d_pool).kind == EventKind.DONE
        assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])
        assert d.stats().frames == 4 and p.stats().frames == 4  # 3 + 3 + 3 + 1


def test_rooms_interleave_on_one_connection_and_across_prefill_workers():
    src_a, src_b = random_pool(NUM_PAGES, 16, torch.float32, 1), random_pool(NUM_PAGES, 16, torch.float32, 3)
    dst = random_pool(2 * NUM_PAGES, 16, torch.float32, 2)
    with PrefillTransfer(src_a, "m", config=FAST) as a, PrefillTransfer(src_b, "m", config=FAST) as b:
        with DecodeTransfer(dst, "m", config=FAST) as d:
            pools = {a: PagePool(NUM_PAGES), b: PagePool(NUM_PAGES)}
            d_pool = PagePool(2 * NUM_PAGES)
            plan = {1: (a, 5), 2: (b, 7), 3: (a, 3), 4: (b, 1)}
            pages = {room: handshake(p, d, pools[p], d_pool, room, n) for room, (p, n) in plan.items()}
            for i in range(7):  # one page of each room in turn
                for room, (p, n) in plan.items():
                    if i < n:
                        p.send_pages(room, [pages[room][0][i]])
            for room, (p, _) in plan.items():
                p.finish(room, {"room": room})
            for room, (p, _) in plan.items():
                ev = poll_until(d, room, pool=d_pool)
                assert (ev.kind, ev.metadata) == (EventKind.DONE, {"room": room})
                src = src_a if p is a else src_b
                assert torch.equal(dst[:, :, pages[room][1]], src[:, :, pages[room][0]])
                assert poll_until(p, room, pool=pools[p]).kind == EventKind.DONE
            assert d_pool.clean and all(pool.clean for pool in pools.values())


def test_the_decode_side_may_announce_before_the_request_reaches_the_prefill_side(ends):
    p, d, src, dst = ends
    d.expect(9, HOST, p.port, [3, 4], skip_pages=1)
    wait_state(d, 9, DecodeState.WAITING)
    assert p.state(9) is None and p.poll() == []  # held, not reported: the request has not come
    p.expect(9)
    ev = poll_until(p, 9)
    assert (ev.kind, ev.pages, ev.skip_pages) == (EventKind.READY, 2, 1)
    p.send_pages(9, [10, 11])
    p.finish(9)
    assert poll_until(d, 9).kind == EventKind.DONE
    assert torch.equal(dst[:, :, [3, 4]], src[:, :, [10, 11]])


@pytest.mark.parametrize(
    "field,theirs",
    [
        ("page_size", 1),
        ("dtype", torch.bfloat16),
        ("num_layers", 4),
        ("num_kv_heads", 3),
        ("head_dim", 16),
        ("model", "other"),
    ],
)
def test_a_layout_mismatch_fails_both_sides_naming_both_values(field, theirs):
    shape = {"page_size": 16, "dtype": torch.float32, "layers": 3, "heads": 2, "dim": 8}
    decode_shape = dict(shape)
    key = {"num_layers": "layers", "num_kv_heads": "heads", "head_dim": "dim"}.get(field, field)
    if field != "model":
        decode_shape[key] = theirs
    src = random_pool(8, shape["page_size"], shape["dtype"], 1, shape["layers"], shape["heads"], shape["dim"])
    ds = decode_shape
    dst = random_pool(8, ds["page_size"], ds["dtype"], 2, ds["layers"], ds["heads"], ds["dim"])
    with PrefillTransfer(src, "m", config=FAST) as p:
        with DecodeTransfer(dst, theirs if field == "model" else "m", config=FAST) as d:
            p.expect(1)
            d.expect(1, HOST, p.port, [0, 1])
            ev_d, ev_p = poll_until(d, 1), poll_until(p, 1)
            assert ev_d.kind == ev_p.kind == EventKind.FAILED
            mine, other = getattr(p.layout, field), getattr(d.layout, field)
            want = f"{field} {mine!r} (prefill) != {other!r} (decode)"
            for ev in (ev_d, ev_p):
                assert "KV layout mismatch" in ev.error and want in ev.error, ev.error
                assert f"{HOST}:{p.port}" in ev.error
            # the next room to that worker fails the same way (the handshake is tried again)
            d.expect(2, HOST, p.port, [2])
            assert want in poll_until(d, 2).error


def test_a_decode_side_without_pages_refuses(ends):
    p, d, _, _ = ends
    p.expect(3)
    d.refuse(3, HOST, p.port, "no free KV pages")
    ev = poll_until(p, 3)
    assert ev.kind == EventKind.FAILED
    assert "could not reserve KV pages" in ev.error and "no free KV pages" in ev.error
    d.refuse(4, HOST, p.port, "pool full")  # before the prefill side has the request (most likely)
    assert quiet_for(p, 0.2) == [] and p.state(4) is None
    p.expect(4)
    assert "pool full" in poll_until(p, 4).error
    assert quiet_for(d, 0.2) == []  # a refused room was never the decode side's


# -- aborts: from either side, at every state -----------------------------------------------------

PREFILL_STATES = ["bootstrapping", "ready", "transferring", "awaiting_ack"]
DECODE_STATES = ["waiting", "receiving", "received"]


def drive_to(p, d, p_pool, d_pool, room, state):
    """Run one room (4 pages) until the named state of either side; returns (src pages, dst pages)."""
    if state == "bootstrapping":
        p.expect(room)
        return p_pool.reserve(room, 4), None
    src_pages, dst_pages = handshake(p, d, p_pool, d_pool, room, 4)
    if state in ("transferring", "receiving"):
        p.send_pages(room, src_pages[:2])
        wait_state(d, room, DecodeState.RECEIVING)
    if state in ("awaiting_ack", "received"):
        p.send_pages(room, src_pages)
        p.finish(room)
        wait_state(d, room, DecodeState.RECEIVED)  # the decode side has not polled: no ack yet
        assert p.state(room) == PrefillState.AWAITING_ACK
    return src_pages, dst_pages


@pytest.mark.parametrize("state", PREFILL_STATES)
def test_the_prefill_side_aborts(ends, state):
    p, d, _, dst = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    drive_to(p, d, p_pool, d_pool, 7, state)
    assert p.state(7) == PrefillState(state)
    p.abort(7, "the client went away")
    p_pool.release(7)  # the caller's own abort: its pages are its own again
    if state == "bootstrapping":  # the decode side's announcement comes late: answered with an abort
        d.expect(7, HOST, p.port, d_pool.reserve(7, 4))
    if state == "awaiting_ack":  # every page is there: a poll before the abort arrives would complete it
        wait_state(d, 7, DecodeState.FAILED)
    ev = poll_until(d, 7, pool=d_pool)
    assert ev.kind == EventKind.FAILED and "the client went away" in ev.error, ev
    assert "aborted by the prefill side" in ev.error
    snapshot = dst.clone()
    assert quiet_for(p, 0.2) == [] and quiet_for(d, 0.1) == []  # the aborting side never hears of it again
    assert torch.equal(dst, snapshot)  # nothing of the room is written once its end was reported
    assert p.state(7) is None and d.state(7) is None
    assert p_pool.clean and d_pool.clean


@pytest.mark.parametrize("state", DECODE_STATES)
def test_the_decode_side_aborts(ends, state):
    p, d, _, dst = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    src_pages, _ = drive_to(p, d, p_pool, d_pool, 8, state)
    assert d.state(8) == DecodeState(state)
    snapshot = dst.clone()
    d.abort(8, "the client went away")
    d_pool.release(8)
    if state == "receiving":  # pages still coming for it: dropped
        p.send_pages(8, src_pages[2:])
    ev = poll_until(p, 8, pool=p_pool)
    assert ev.kind == EventKind.FAILED and "aborted by the decode side: the client went away" in ev.error
    assert quiet_for(d, 0.2) == []
    assert torch.equal(dst, snapshot)  # the pages it had received but not applied were never written
    assert p_pool.clean and d_pool.clean
    assert p.send_pages(8, src_pages[:1]) is False and p.finish(8) is False  # ended: the caller stops


def test_an_abort_after_an_unpolled_end_replaces_it(ends):
    """The room failed on the network thread, the caller aborts it before polling: it ends once, by
    the caller's abort (its FAILED event is dropped), so its pages are given back once."""
    p, d, _, _ = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    handshake(p, d, p_pool, d_pool, 13, 2)
    p.abort(13, "first")
    p_pool.release(13)
    wait_state(d, 13, DecodeState.FAILED)
    d.abort(13, "second")
    d_pool.release(13)
    assert quiet_for(d, 0.2) == [] and quiet_for(p, 0.1) == []
    assert p_pool.clean and d_pool.clean


def test_the_decode_side_aborts_while_connecting():
    """Aborted before the handshake finished: once connected, the decode side announces nothing and
    tells the prefill worker (which may hold the request) to abort."""
    listener = RawListener()
    dst = random_pool(8, 16, torch.float32, 2)
    try:
        with DecodeTransfer(dst, "m", config=FAST) as d:
            d.expect(12, HOST, listener.port, [0, 1])
            conn = listener.accept()
            assert conn.recv()[0] == wire.Kind.HELLO
            assert d.state(12) == DecodeState.CONNECTING
            d.abort(12, "gone")
            conn.send(wire.Kind.HELLO_OK, 0, {"version": wire.VERSION, "layout": d.layout.to_wire()})
            kind, room, meta, _ = conn.recv()
            assert (kind, room) == (wire.Kind.ABORT, 12) and "gone" in meta["reason"]
            assert quiet_for(d, 0.2) == []
            conn.close()
    finally:
        listener.close()


# -- a peer that dies ----------------------------------------------------------------------------


@pytest.mark.timeout(180)  # a process that imports torch: slow on a loaded machine
def test_a_prefill_worker_killed_mid_transfer(ends):
    _, d, _, _ = ends
    peer = PeerProcess("prefill", "--room", "21", "--pages", "8", "--send", "3")
    try:
        port = int(peer.line("port"))
        d_pool = PagePool(NUM_PAGES)
        d.expect(21, HOST, port, d_pool.reserve(21, 8))
        d.expect(22, HOST, port, d_pool.reserve(22, 2))  # a second room of that worker, nothing sent yet
        peer.line("sent")
        wait_state(d, 21, DecodeState.RECEIVING)
        peer.kill()
        for room in (21, 22):
            ev = poll_until(d, room, pool=d_pool)
            assert (
                ev.kind == EventKind.FAILED and f"the prefill worker at {HOST}:{port} closed the connection" in ev.error
            )
        assert d_pool.clean and quiet_for(d, 0.2) == []
    finally:
        peer.kill()


@pytest.mark.timeout(180)  # a process that imports torch: slow on a loaded machine
@pytest.mark.parametrize("ends", [(16, torch.float32, dataclasses.replace(FAST, bootstrap_timeout=120))], indirect=True)
def test_a_decode_worker_killed_mid_transfer(ends):
    p, _, _, _ = ends
    p_pool = PagePool(NUM_PAGES)
    p.expect(31)
    pages = p_pool.reserve(31, 8)
    peer = PeerProcess("decode", "--port", str(p.port), "--room", "31", "--pages", "8")
    try:
        assert poll_until(p, 31, timeout=120).kind == EventKind.READY
        p.send_pages(31, pages[:3])
        peer.line("state receiving")
        peer.kill()
        ev = poll_until(p, 31, pool=p_pool)
        assert (
            ev.kind == EventKind.FAILED and "the decode worker at" in ev.error and "closed the connection" in ev.error
        )
        assert p.send_pages(31, pages[3:]) is False
        assert p_pool.clean and quiet_for(p, 0.2) == []
    finally:
        peer.kill()


# -- every wait times out --------------------------------------------------------------------------


def short(**waits: float) -> TransferConfig:
    """FAST with only the waits under test short (the others stay long: a loaded machine trips no other)."""
    return dataclasses.replace(FAST, **waits)


@pytest.mark.parametrize("ends", [(16, torch.float32, short(bootstrap_timeout=0.3))], indirect=True)
def test_no_announcement_within_bootstrap_timeout(ends):
    p, _, _, _ = ends
    p.expect(1)
    ev = poll_until(p, 1, timeout=5)
    assert ev.kind == EventKind.FAILED and "bootstrap_timeout" in ev.error


def test_an_announced_room_the_prefill_side_never_gets():
    """Held for bootstrap_timeout, then the decode side is told (well before its own transfer_timeout)."""
    with PrefillTransfer(random_pool(4, 16, torch.float32, 1), "m", config=short(bootstrap_timeout=0.3)) as p:
        with DecodeTransfer(random_pool(4, 16, torch.float32, 2), "m", config=FAST) as d:
            d.expect(2, HOST, p.port, [0])
            ev = poll_until(d, 2, timeout=4)
            assert ev.kind == EventKind.FAILED and "did not get this request within 0.3 s" in ev.error


@pytest.mark.parametrize("ends", [(16, torch.float32, short(transfer_timeout=0.3))], indirect=True)
def test_no_pages_within_transfer_timeout(ends):
    """Waiting for the first pages and between batches alike; the prefill side is told."""
    p, d, _, _ = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    handshake(p, d, p_pool, d_pool, 3, 2)  # READY: never sends
    src, _ = handshake(p, d, p_pool, d_pool, 4, 2)
    p.send_pages(4, src[:1])  # one batch, then silence
    for room in (3, 4):
        ev = poll_until(d, room, timeout=5, pool=d_pool)
        assert ev.kind == EventKind.FAILED and "transfer_timeout" in ev.error
        ev = poll_until(p, room, timeout=5, pool=p_pool)
        assert ev.kind == EventKind.FAILED and "transfer_timeout" in ev.error
    assert p_pool.clean and d_pool.clean


@pytest.mark.parametrize("ends", [(16, torch.float32, short(ack_timeout=0.3))], indirect=True)
def test_no_confirmation_within_ack_timeout(ends):
    p, d, _, _ = ends
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    src, _ = handshake(p, d, p_pool, d_pool, 5, 2)
    p.send_pages(5, src)
    p.finish(5)
    wait_state(d, 5, DecodeState.RECEIVED)  # the decode side does not poll: no confirmation
    ev = poll_until(p, 5, timeout=5, pool=p_pool)
    assert ev.kind == EventKind.FAILED and "ack_timeout" in ev.error
    wait_state(d, 5, DecodeState.FAILED)  # told: its pages are not to be used
    ev = poll_until(d, 5, pool=d_pool)
    assert ev.kind == EventKind.FAILED and "ack_timeout" in ev.error
    assert p_pool.clean and d_pool.clean


def test_a_prefill_worker_that_never_answers_the_handshake():
    listener = RawListener()  # accepts, answers nothing
    try:
        with DecodeTransfer(random_pool(4, 16, torch.float32, 2), "m", config=short(connect_timeout=0.3)) as d:
            d.expect(6, HOST, listener.port, [0])
            ev = poll_until(d, 6, timeout=5)
            assert ev.kind == EventKind.FAILED and "0.3 s" in ev.error, ev
    finally:
        listener.close()


def test_nobody_listening_on_the_bootstrap_port():
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]  # closed again: nobody listens there
    with DecodeTransfer(random_pool(4, 16, torch.float32, 2), "m", config=FAST) as d:
        d.expect(7, HOST, port, [0])
        ev = poll_until(d, 7, timeout=5)
        assert ev.kind == EventKind.FAILED and f"{HOST}:{port}" in ev.error and "refused" in ev.error, ev


@pytest.mark.parametrize("ends", [(16, torch.float32, short(connect_timeout=0.3))], indirect=True)
def test_a_decode_peer_that_says_nothing_is_dropped(ends):
    p, _, _, _ = ends
    conn = raw_connect(p.port)
    assert conn.closed_by_peer(5)  # no hello within connect_timeout


def test_a_decode_peer_that_stops_reading_fails_its_rooms():
    """send_timeout: the peer's window and the socket buffers fill, the write does not drain."""
    src = random_pool(128, 16, torch.float32, 1, layers=4, heads=4, dim=64)  # 128 KiB a page, 16 MiB in all
    with PrefillTransfer(src, "m", config=short(send_timeout=0.5)) as p:
        conn = raw_connect(p.port, rcvbuf=4096)
        conn.send(wire.Kind.HELLO, 0, hello(p.layout, max_frame_bytes=1 << 20))
        assert conn.recv()[0] == wire.Kind.HELLO_OK
        p.expect(8)
        conn.send(wire.Kind.ANNOUNCE, 8, {"pages": 128, "skip_pages": 0})
        assert poll_until(p, 8).kind == EventKind.READY
        p.send_pages(8, list(range(128)))  # and the peer reads no more
        ev = poll_until(p, 8, timeout=10)
        assert ev.kind == EventKind.FAILED and "send timed out" in ev.error, ev
        conn.close()


# -- what a caller may not do, and bad peers --------------------------------------------------------


def test_misuse_is_a_clear_error(ends):
    p, d, _, _ = ends
    p.expect(1)
    with pytest.raises(ValueError, match="expected already"):
        p.expect(1)
    with pytest.raises(ValueError, match="bootstrapping: pages go after READY"):
        p.send_pages(1, [0])
    d.expect(1, HOST, p.port, [0, 1])
    assert poll_until(p, 1).kind == EventKind.READY
    with pytest.raises(ValueError, match="0 \\+ 3 pages > the 2 the decode side reserved"):
        p.send_pages(1, [0, 1, 2])
    with pytest.raises(IndexError, match="gather_kv_pages"):
        p.send_pages(1, [0, NUM_PAGES])  # not a page of the pool: nothing is sent, nothing counted
    assert p.state(1) == PrefillState.READY and p.stats().pages == 0
    with pytest.raises(TypeError):
        p.finish(1, {"not json": object()})
    assert p.finish(1, {})
    with pytest.raises(ValueError, match="awaiting_ack: finish\\(\\) comes after READY, once"):
        p.finish(1, {})
    with pytest.raises(ValueError, match="distinct pool pages"):
        d.expect(2, HOST, p.port, [3, 3])
    with pytest.raises(ValueError, match="distinct pool pages"):
        d.expect(2, HOST, p.port, [NUM_PAGES])
    with pytest.raises(ValueError, match="expected already"):
        d.expect(1, HOST, p.port, [4])
    assert p.send_pages(99, [0]) is False and p.finish(99) is False  # a room it does not hold
    d.abort(99)
    p.abort(99)  # nothing to end: no error
    with pytest.raises(OSError):
        PrefillTransfer(random_pool(4, 16, torch.float32, 1), "m", port=p.port)  # the port is taken
    p.close()
    with pytest.raises(RuntimeError, match="closed"):
        p.expect(5)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"bootstrap_timeout": 0},
        {"ack_timeout": -1.0},
        {"send_timeout": float("nan")},
        {"connect_timeout": float("inf")},
        {"max_frame_bytes": 1.5},
    ],
)
def test_a_bad_config_is_refused(kwargs):
    with pytest.raises(ValueError, match="TransferConfig"):
        TransferConfig(**kwargs)


def test_a_garbage_peer_is_dropped_and_the_others_carry_on(ends):
    p, d, src, dst = ends
    conn = raw_connect(p.port)
    conn.sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(32))
    assert conn.closed_by_peer(5)
    p_pool, d_pool = PagePool(NUM_PAGES), PagePool(NUM_PAGES)
    src_pages, dst_pages = handshake(p, d, p_pool, d_pool, 1, 2)
    p.send_pages(1, src_pages)
    p.finish(1)
    assert poll_until(d, 1, pool=d_pool).kind == EventKind.DONE
    assert torch.equal(dst[:, :, dst_pages], src[:, :, src_pages])


def test_a_prefill_peer_sending_pages_out_of_order_fails_the_room():
    listener = RawListener()
    dst = random_pool(8, 16, torch.float32, 2)
    try:
        with DecodeTransfer(dst, "m", config=FAST) as d:
            d.expect(3, HOST, listener.port, [0, 1, 2])
            conn = listener.accept()
            conn.recv()
            conn.send(wire.Kind.HELLO_OK, 0, {"version": wire.VERSION, "layout": d.layout.to_wire()})
            assert conn.recv()[:2] == (wire.Kind.ANNOUNCE, 3)
            page = bytes(d.layout.bytes_per_page)
            conn.send(wire.Kind.PAGES, 3, {"start": 1, "n": 1}, page)  # page 0 skipped
            ev = poll_until(d, 3)
            assert ev.kind == EventKind.FAILED and "do not follow" in ev.error
            kind, room, meta, _ = conn.recv()
            assert (kind, room) == (wire.Kind.ABORT, 3) and "do not follow" in meta["reason"]
            conn.close()
    finally:
        listener.close()
