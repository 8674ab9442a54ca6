"""The port layout and string ids: encode/decode, limits, and the host server's side of the
protocol driven by hand (the test plays the device by writing port words), so every opcode,
batching, the pool and every error path run without a kernel."""
from __future__ import annotations

import io
import logging
import threading
import time

import pytest

from warploop.std import strings
from warploop.std.handlers import HostFunction
from warploop.std.protocol import (
    PAYLOAD_WORDS,
    PORT_WORDS,
    Opcode,
    PortSlot,
    State,
    Status,
    Word,
    allocate_ports,
    float_to_word,
    word_to_float,
)
from warploop.std.server import HostServer


def test_slot_round_trip():
    slot = PortSlot(state=State.POSTED, result=-5, status=Status.BAD_FD, seq=9, opcode=Opcode.CALL,
                    call_id=strings.intern("f"), worker=3, argc=3, float_mask=0b010, want_float=True, then=77,
                    payload=(1, float_to_word(2.5), -3))
    words = slot.serialize()
    assert len(words) == PORT_WORDS
    assert words[Word.FLAGS] == 3 | (0b010 << 8) | (1 << 16)
    back = PortSlot.parse(words)
    assert back == slot
    assert back.args() == [1, 2.5, -3]
    assert back.payload == (1, float_to_word(2.5), -3) + (0,) * (PAYLOAD_WORDS - 3)


def test_slot_limits():
    with pytest.raises(ValueError, match="at most 7"):
        PortSlot(argc=PAYLOAD_WORDS + 1)
    with pytest.raises(ValueError, match="payload has 8 words"):
        PortSlot(payload=(0,) * 8)
    with pytest.raises(ValueError, match="16 words"):
        PortSlot.parse([0] * 15)


def test_float_words():
    for x in (0.0, -1.5, 1e300, float("inf")):
        assert word_to_float(float_to_word(x)) == x


def test_string_ids_are_stable_and_registered():
    sid = strings.intern("x=%d")
    assert sid == strings.intern("x=%d") == strings.string_id("x=%d") > 0
    assert strings.lookup(sid) == "x=%d"
    assert strings.lookup(strings.string_id("never interned")) is None
    with pytest.raises(TypeError):
        strings.intern(5)


def test_allocate_ports_owners():
    ports = allocate_ports(3, slots_per_worker=2, pinned=False)
    assert ports.shape == (6, PORT_WORDS)
    assert ports[:, Word.WORKER].tolist() == [0, 0, 1, 1, 2, 2]
    assert ports[:, Word.STATE].eq(State.FREE).all()
    with pytest.raises(ValueError):
        allocate_ports(0)


def post(ports, index, opcode, call_id=0, args=(), want_float=False, then=0):
    """Play the device: fill a port and mark it POSTED."""
    fmask = sum(1 << i for i, a in enumerate(args) if isinstance(a, float))
    slot = PortSlot(state=State.FREE, opcode=opcode, call_id=call_id, worker=index, argc=len(args),
                    float_mask=fmask, want_float=want_float, then=then,
                    payload=tuple(float_to_word(a) if isinstance(a, float) else a for a in args))
    words = slot.serialize()
    words[Word.SEQ] = int(ports[index, Word.SEQ])
    row = ports.numpy()[index]
    row[1:] = words[1:]
    row[Word.STATE] = State.POSTED    # last, as the device's release does


def wait_done(ports, index, timeout=5.0) -> PortSlot:
    deadline = time.monotonic() + timeout
    while ports[index, Word.STATE] != State.DONE:
        assert time.monotonic() < deadline, f"port {index} never answered"
        time.sleep(1e-4)
    return PortSlot.parse(ports[index].tolist())


def test_one_pass_answers_every_kind_of_request(caplog):
    ports = allocate_ports(8, pinned=False)
    out = io.StringIO()
    replies = []
    server = HostServer(ports, out=out, on_reply=lambda *r: replies.append(r))
    add = server.register_function("add", lambda a, b: a + b, inline=True)
    half = server.register_function("half", lambda x: x / 2)                           # on the pool
    boom = server.register_function("boom", lambda: 1 / 0, inline=True)
    many = server.register_function("many", lambda a, b: a * 10 + b, vectorized=True)
    post(ports, 0, Opcode.PRINT, strings.intern("a=%d b=%.1f"), (7, 0.5))
    post(ports, 1, Opcode.CALL, add, (2, 3), then=11)
    post(ports, 2, Opcode.CALL, boom)
    post(ports, 3, Opcode.CALL, strings.intern("nobody registered me"))
    post(ports, 4, 99)
    post(ports, 5, Opcode.CALL, many, (1, 2))
    post(ports, 6, Opcode.CALL, many, (3, 4), want_float=True)
    post(ports, 7, Opcode.TIME)
    with caplog.at_level(logging.WARNING, logger="warploop.std"):
        assert server.serve_once() == 8
    assert out.getvalue() == "a=7 b=0.5\n"
    p = [PortSlot.parse(row) for row in ports.tolist()]
    assert all(s.state == State.DONE and s.seq == 1 for s in p)
    assert (p[0].status, p[1].result, p[1].status) == (Status.OK, 5, Status.OK)
    assert (p[2].status, p[2].result) == (Status.CALLBACK_ERROR, 0)
    assert p[3].status == Status.UNKNOWN_ID
    assert (p[4].status, p[4].result) == (Status.UNKNOWN_OPCODE, -Status.UNKNOWN_OPCODE)
    assert (p[5].result, word_to_float(p[6].result)) == (12, 34.0)
    assert abs(p[7].result - time.time_ns()) < 5e9
    assert replies == [(1, 11, 0, 5)]
    assert server.errors == 3 and server.served == 8
    logged = caplog.text
    assert "CALLBACK_ERROR" in logged and "ZeroDivisionError" in logged and "UNKNOWN_ID" in logged
    # The pool is only used once the server runs; the server keeps serving after errors.
    with server:
        post(ports, 0, Opcode.CALL, half, (5,), want_float=True)
        post(ports, 1, Opcode.CALL, add, (1, 1))
        assert word_to_float(wait_done(ports, 0).result) == 2.5
        assert wait_done(ports, 1).result == 2


def test_slow_callback_does_not_stall_others():
    ports = allocate_ports(2, pinned=False)
    release = threading.Event()
    server = HostServer(ports, functions={"slow": lambda: release.wait(10) and 1, "fast": lambda: 2})
    with server:
        post(ports, 0, Opcode.CALL, strings.intern("slow"))
        post(ports, 1, Opcode.CALL, strings.intern("fast"))
        assert wait_done(ports, 1).result == 2
        assert ports[0, Word.STATE] == State.TAKEN
        release.set()
        assert wait_done(ports, 0).result == 1


def test_bad_results_and_format_errors():
    ports = allocate_ports(4, pinned=False)
    server = HostServer(ports, out=io.StringIO())
    big = server.register_function("big", lambda: 1 << 70, inline=True)
    text = server.register_function("text", lambda: "no", inline=True)
    post(ports, 0, Opcode.CALL, big)
    post(ports, 1, Opcode.CALL, text)
    post(ports, 2, Opcode.PRINT, strings.intern("%d and %d"), (1,))
    post(ports, 3, Opcode.PRINT, strings.string_id("an unregistered format"))
    server.serve_once()
    assert [int(s) for s in ports[:, Word.STATUS]] == [Status.CALLBACK_ERROR, Status.CALLBACK_ERROR,
                                                       Status.BAD_ARGUMENT, Status.UNKNOWN_ID]


def test_stop_drains_requests_posted_and_never_waited_for():
    ports = allocate_ports(3, pinned=False)
    out = io.StringIO()
    server = HostServer(ports, out=out, spin_us=0, max_sleep_us=1e6).start()
    for i in range(3):     # async prints nobody waits for; the server sleeps through them
        post(ports, i, Opcode.PRINT, strings.intern("line %d"), (i,))
    server.stop()
    assert sorted(out.getvalue().splitlines()) == ["line 0", "line 1", "line 2"]


def test_sleeping_server_sees_a_request_within_its_timeout():
    ports = allocate_ports(1, pinned=False)
    with HostServer(ports, spin_us=0, max_sleep_us=2000, functions={"one": HostFunction(lambda: 1, inline=True)}):
        time.sleep(0.05)    # long past the spin: the server is asleep, and nothing wakes it
        post(ports, 0, Opcode.CALL, strings.intern("one"))
        assert wait_done(ports, 0, timeout=1.0).result == 1


def test_watch_limits_the_scan_and_host_calls_bind():
    from warploop.std.runtime import HostCalls

    ports = allocate_ports(4, pinned=False)
    server = HostServer(ports, functions={"one": HostFunction(lambda: 1, inline=True)})
    server.watch(2)
    post(ports, 3, Opcode.CALL, strings.intern("one"))
    assert server.serve_once() == 0                        # port 3 belongs to no caller now
    post(ports, 1, Opcode.CALL, strings.intern("one"))
    assert server.serve_once() == 1
    with pytest.raises(ValueError):
        server.watch(5)
    calls = HostCalls(max_workers=8, device="cpu")
    assert calls.ports.shape == (16, PORT_WORDS)
    calls.bind(type("FakeRuntime", (), {"workers": 3})())
    assert len(calls.server._state) == 6
    with pytest.raises(ValueError, match="max_workers=9"):
        calls.bind(type("FakeRuntime", (), {"workers": 9})())


def test_a_broken_output_stream_or_hook_fails_the_callers_not_the_server(caplog):
    ports = allocate_ports(2, pinned=False)
    out = io.StringIO()
    out.close()
    server = HostServer(ports, out=out, on_reply=lambda *r: 1 / 0,
                        functions={"one": HostFunction(lambda: 1, inline=True)})
    post(ports, 0, Opcode.PRINT, strings.intern("lost %d"), (1,))
    post(ports, 1, Opcode.CALL, strings.intern("one"), then=5)
    with caplog.at_level(logging.WARNING, logger="warploop.std"):
        assert server.serve_once() == 2
    assert [int(s) for s in ports[:, Word.STATE]] == [State.DONE, State.DONE]
    assert (int(ports[0, Word.STATUS]), int(ports[1, Word.RESULT])) == (Status.IO_ERROR, 1)
    assert "could not be written" in caplog.text and "on_reply hook failed" in caplog.text
