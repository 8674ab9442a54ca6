"""Hostile requests through the running host server, the way device code makes them (the test plays
the device by writing port words): each is answered with an error status within a deadline, the
port never stays TAKEN, and the server keeps answering everyone else."""
from __future__ import annotations

import os
import threading
import time

import pytest

from warploop.std import strings
from warploop.std.files import FileTable
from warploop.std.protocol import Opcode, OpenMode, PortSlot, State, Status, Word, allocate_ports
from warploop.std.server import HostServer

DEADLINE_S = 2.0


def call(ports, index: int, opcode: Opcode, call_id: int = 0, args: tuple = ()) -> PortSlot:
    """Post one request on port `index` and wait (at most DEADLINE_S) for its reply."""
    row = ports.numpy()[index]
    words = PortSlot(opcode=opcode, call_id=call_id, argc=len(args), payload=args).serialize()
    row[Word.OPCODE:] = words[Word.OPCODE:]
    row[Word.STATE] = State.POSTED    # last, as the device's release does
    deadline = time.monotonic() + DEADLINE_S
    while row[Word.STATE] != State.DONE:
        assert time.monotonic() < deadline, f"port {index} still {State(int(row[Word.STATE])).name}"
        time.sleep(1e-4)
    reply = PortSlot.parse(row.tolist())
    row[Word.STATE] = State.FREE
    return reply


@pytest.fixture
def served(tmp_path):
    ports = allocate_ports(2, pinned=False)
    with HostServer(ports, files=FileTable(tmp_path)) as server:
        yield ports, server, tmp_path


def test_nul_byte_path_is_an_error_status(served):
    ports, server, root = served
    reply = call(ports, 0, Opcode.OPEN, strings.intern("evil\0name"), (OpenMode.WRITE,))
    assert (reply.status, reply.result) == (Status.BAD_ARGUMENT, -Status.BAD_ARGUMENT)
    assert list(root.iterdir()) == []
    assert call(ports, 1, Opcode.TIME).status == Status.OK


def test_fifo_path_is_answered_and_blocks_nobody(served):
    ports, server, root = served
    os.mkfifo(root / "pipe")
    for mode, statuses in ((OpenMode.READ, {Status.NOT_PERMITTED}),
                           (OpenMode.WRITE, {Status.IO_ERROR, Status.NOT_PERMITTED})):
        reply = call(ports, 0, Opcode.OPEN, strings.intern("pipe"), (mode,))
        assert reply.status in statuses and reply.result < 0
    assert call(ports, 1, Opcode.TIME).status == Status.OK


def test_any_exception_in_a_handler_answers_the_caller(served, monkeypatch):
    ports, server, root = served

    def broken_open(path, mode):   # the realpath race of old: an OSError no handler expected
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(server.files, "open", broken_open)
    reply = call(ports, 0, Opcode.OPEN, strings.intern("x"), (OpenMode.READ,))
    assert (reply.status, reply.result) == (Status.IO_ERROR, -Status.IO_ERROR)

    def broken_read(files, fd, ptr, nbytes, offset):   # on the pool
        raise ValueError("no")

    monkeypatch.setattr(server.buffers, "read_file", broken_read)
    reply = call(ports, 1, Opcode.READ, 0, (3, 0, 8, 0))
    assert reply.status == Status.BAD_ARGUMENT
    assert server.errors == 2


def test_a_slow_host_function_does_not_stop_file_calls(served):
    ports, server, root = served
    release = threading.Event()
    slow = server.register_function("slow", lambda: release.wait(DEADLINE_S * 5) and 1)
    row = ports.numpy()[0]
    row[Word.OPCODE], row[Word.CALL_ID], row[Word.FLAGS] = Opcode.CALL, slow, 0
    row[Word.STATE] = State.POSTED
    os.mkfifo(root / "pipe")
    assert call(ports, 1, Opcode.OPEN, strings.intern("pipe"), (OpenMode.READ,)).status == Status.NOT_PERMITTED
    release.set()
