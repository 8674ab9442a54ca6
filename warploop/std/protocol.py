"""The GPU->host call protocol: ports, defined once here as data.

A port is a 16-word int64 mailbox in pinned, mapped host memory (128 bytes, two cache lines).
One caller owns a port at a time: every resident worker has at least one, so every caller can
always make progress and no caller ever waits for another one's call. A call goes:

    device: write OPCODE, CALL_ID, FLAGS, THEN, PAYLOAD   (plain stores)
    device: STATE <- POSTED                               (atomic exchange, release, system scope)
    host:   sees POSTED, STATE <- TAKEN, does the work
    host:   write RESULT, STATUS, SEQ += 1, fence, STATE <- DONE
    device: sees STATE == DONE with RESULT in the same 16-byte load, STATE <- FREE

STATE and RESULT share the first 16 bytes so that the device's poll returns the reply with the
state: one PCIe read instead of two (the host writes RESULT before STATE, in order). WORKER is
written by the host when the ports are created (the owner); the device never writes it.
Device code decodes exactly this layout (warploop/std/device.py); docs/std.md documents it.
"""
from __future__ import annotations

import dataclasses
import enum
import struct

PORT_WORDS = 16
PAYLOAD_WORDS = 7
SLOTS_PER_WORKER = 2    # ports per runtime worker: slot 0 for synchronous calls, slot 1 for one async call


class Word(enum.IntEnum):
    """Word offsets inside a port."""

    STATE = 0      # State: FREE, POSTED, TAKEN, DONE
    RESULT = 1     # reply value: int64, or float64 bits when the request asked for a float
    STATUS = 2     # reply Status (0 = OK)
    SEQ = 3        # replies sent on this port so far (host counts; lost or doubled replies show here)
    OPCODE = 4     # Opcode of the request
    CALL_ID = 5    # string id of the format (PRINT), path (OPEN) or function name (CALL)
    WORKER = 6     # owner worker of the port, written once by the host
    FLAGS = 7      # argc (bits 0-3), float mask of the args (bits 8-14), float result wanted (bit 16)
    THEN = 8       # continuation token of an async request (0: none), handed to the server's on_reply
    PAYLOAD = 9    # PAYLOAD_WORDS request arguments: int64, or float64 bits where the float mask says so


class State(enum.IntEnum):
    FREE = 0
    POSTED = 1
    TAKEN = 2
    DONE = 3


class Opcode(enum.IntEnum):
    PRINT = 1   # call_id: format string; payload: the scalars; result 0
    TIME = 2    # result: host wall clock, ns since the epoch
    OPEN = 3    # call_id: path string; payload: [mode]; result: fd
    READ = 4    # payload: [fd, device pointer, nbytes, offset]; result: bytes read
    WRITE = 5   # payload: [fd, device pointer, nbytes]; result: bytes written
    CLOSE = 6   # payload: [fd]; result 0
    CALL = 7    # call_id: function name; payload: its scalars; result: its return value


class Status(enum.IntEnum):
    OK = 0
    UNKNOWN_OPCODE = 1
    UNKNOWN_ID = 2        # no string or function is registered under CALL_ID
    CALLBACK_ERROR = 3    # the host function raised, or returned something that is not a scalar
    BAD_FD = 4
    SHORT_READ = 5        # fewer bytes than asked (end of file); RESULT still holds the count
    NOT_PERMITTED = 6     # outside the files root, no root given, or the files are read-only
    IO_ERROR = 7
    BAD_ARGUMENT = 8      # bad mode or size, a pointer outside every registered buffer, bad format args
    TOO_MANY_FILES = 9


class OpenMode(enum.IntEnum):
    READ = 0
    WRITE = 1    # create or truncate
    APPEND = 2   # create or append


ARGC_MASK = 0xF
FLOAT_MASK_SHIFT = 8
WANT_FLOAT_BIT = 1 << 16


class StdError(Exception):
    """A request the host refuses; the server turns it into `status` for the caller and a log line."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


def float_to_word(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def word_to_float(w: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(w)))[0]


@dataclasses.dataclass
class PortSlot:
    """One port's contents, decoded. `serialize()` gives the PORT_WORDS int64 words."""

    state: int = State.FREE
    result: int = 0
    status: int = Status.OK
    seq: int = 0
    opcode: int = 0
    call_id: int = 0
    worker: int = 0
    argc: int = 0
    float_mask: int = 0
    want_float: bool = False
    then: int = 0
    payload: tuple[int, ...] = (0,) * PAYLOAD_WORDS

    def __post_init__(self) -> None:
        if not 0 <= self.argc <= PAYLOAD_WORDS:
            raise ValueError(f"argc={self.argc}: a port carries at most {PAYLOAD_WORDS} arguments")
        if len(self.payload) != PAYLOAD_WORDS:
            self.payload = tuple(self.payload) + (0,) * (PAYLOAD_WORDS - len(self.payload))
        if len(self.payload) != PAYLOAD_WORDS:
            raise ValueError(f"payload has {len(self.payload)} words; a port holds {PAYLOAD_WORDS}")

    @property
    def flags(self) -> int:
        return self.argc | (self.float_mask << FLOAT_MASK_SHIFT) | (WANT_FLOAT_BIT if self.want_float else 0)

    def serialize(self) -> list[int]:
        words = [0] * PORT_WORDS
        words[Word.STATE] = int(self.state)
        words[Word.RESULT] = int(self.result)
        words[Word.STATUS] = int(self.status)
        words[Word.SEQ] = int(self.seq)
        words[Word.OPCODE] = int(self.opcode)
        words[Word.CALL_ID] = int(self.call_id)
        words[Word.WORKER] = int(self.worker)
        words[Word.FLAGS] = self.flags
        words[Word.THEN] = int(self.then)
        words[Word.PAYLOAD:Word.PAYLOAD + PAYLOAD_WORDS] = [int(w) for w in self.payload]
        return words

    @classmethod
    def parse(cls, words) -> PortSlot:
        words = [int(w) for w in words]
        if len(words) != PORT_WORDS:
            raise ValueError(f"a port is {PORT_WORDS} words, got {len(words)}")
        flags = words[Word.FLAGS]
        return cls(state=words[Word.STATE], result=words[Word.RESULT], status=words[Word.STATUS],
                   seq=words[Word.SEQ], opcode=words[Word.OPCODE], call_id=words[Word.CALL_ID],
                   worker=words[Word.WORKER], argc=flags & ARGC_MASK,
                   float_mask=(flags >> FLOAT_MASK_SHIFT) & 0x7F, want_float=bool(flags & WANT_FLOAT_BIT),
                   then=words[Word.THEN], payload=tuple(words[Word.PAYLOAD:Word.PAYLOAD + PAYLOAD_WORDS]))

    def args(self) -> list[int | float]:
        """The request's arguments as Python scalars (float where the float mask says so)."""
        return [word_to_float(w) if self.float_mask >> i & 1 else w
                for i, w in enumerate(self.payload[:self.argc])]


def allocate_ports(workers: int, slots_per_worker: int = 1, pinned: bool | None = None):
    """An int64 tensor [workers * slots_per_worker, PORT_WORDS], zeroed, owners filled in.

    pinned=None pins when CUDA is available: pinned memory is mapped into the GPU's address space
    (UVA), so the tensor's host pointer is passed to kernels directly. Port p belongs to worker
    p // slots_per_worker; slot 0 is for synchronous calls, the others for async calls in flight.
    """
    import torch

    if workers < 1 or slots_per_worker < 1:
        raise ValueError(f"need at least one worker and one slot per worker, got {workers} x {slots_per_worker}")
    if pinned is None:
        pinned = torch.cuda.is_available()
    ports = torch.zeros((workers * slots_per_worker, PORT_WORDS), dtype=torch.int64, pin_memory=pinned)
    ports[:, Word.WORKER] = torch.arange(workers * slots_per_worker) // slots_per_worker
    return ports
