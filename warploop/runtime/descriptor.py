"""The task descriptor: one task instance as 32 int32 words, the unit every worker decodes.

    word  0      opcode       which task body runs (0: NOP, 1-255 reserved for the runtime and
                              warploop.std ports, 256 and up: tasks registered with @warploop.task)
    word  1      node         graph node index, for traces and error reports (-1: dynamic task)
    word  2      param_mask   bit j set: argument j is an index into the graph's parameters
    word  3      signal       counter incremented when the task ends (-1: none)
    words 4-5    wait 0       (counter, signals per run) awaited before the body runs (-1: none)
    words 6-7    wait 1       a second (counter, signals per run)
    words 8-31   args         12 argument slots of int64, low word first

An argument slot holds a pointer as its address, an integer sign-extended, an fp32 as its bit
pattern. Static-graph waits count per run: in run r the worker waits until counter >= r * count,
so counters never need resetting between replays.
"""
from __future__ import annotations

import dataclasses
import struct

DESC_WORDS = 32
MAX_ARGS = 12
MAX_WAITS = 2
ARG_WORD = 8
D_OPCODE, D_NODE, D_PARAM_MASK, D_SIGNAL, D_WAIT = 0, 1, 2, 3, 4

OP_NOP = 0
FIRST_TASK_OPCODE = 256     # 1..255: runtime and warploop.std ports (see docs/runtime.md)
MAX_OPCODE = (1 << 24) - 1

# Argument kinds, as task bodies see them (the `kinds` tuple device-side spawn reads).
K_NONE, K_PTR, K_INT, K_FP32 = 0, 1, 2, 3


@dataclasses.dataclass(frozen=True)
class TaskDescriptor:
    opcode: int
    args: tuple[int, ...] = ()
    node: int = -1
    param_mask: int = 0
    signal: int = -1
    waits: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.opcode <= MAX_OPCODE:
            raise ValueError(f"opcode {self.opcode} out of range 0..{MAX_OPCODE}")
        if len(self.args) > MAX_ARGS:
            raise ValueError(f"a task takes at most {MAX_ARGS} arguments, got {len(self.args)}")
        if len(self.waits) > MAX_WAITS:
            raise ValueError(f"a descriptor holds at most {MAX_WAITS} waits; the graph compiler "
                             f"splits longer ones with NOP instructions")
        if self.param_mask >> MAX_ARGS:
            raise ValueError(f"param_mask {self.param_mask:#x} names arguments past slot {MAX_ARGS - 1}")
        for value in self.args:
            if not -(1 << 63) <= value < (1 << 64):
                raise ValueError(f"argument {value} does not fit 64 bits")
        for counter, count in self.waits:
            if counter < 0 or count < 1:
                raise ValueError(f"bad wait ({counter}, {count}): counter >= 0 and count >= 1")

    def serialize(self) -> list[int]:
        words = [0] * DESC_WORDS
        words[D_OPCODE] = self.opcode
        words[D_NODE] = self.node
        words[D_PARAM_MASK] = self.param_mask
        words[D_SIGNAL] = self.signal
        for i in range(MAX_WAITS):
            counter, count = self.waits[i] if i < len(self.waits) else (-1, 0)
            words[D_WAIT + 2 * i] = counter
            words[D_WAIT + 2 * i + 1] = count
        for j, value in enumerate(self.args):
            words[ARG_WORD + 2 * j:ARG_WORD + 2 * j + 2] = split64(value)
        return words

    @classmethod
    def parse(cls, words: list[int], nargs: int = MAX_ARGS) -> TaskDescriptor:
        if len(words) != DESC_WORDS:
            raise ValueError(f"a descriptor is {DESC_WORDS} words, got {len(words)}")
        waits = tuple((words[D_WAIT + 2 * i], words[D_WAIT + 2 * i + 1]) for i in range(MAX_WAITS)
                      if words[D_WAIT + 2 * i] >= 0)
        args = tuple(join64(words[ARG_WORD + 2 * j], words[ARG_WORD + 2 * j + 1]) for j in range(nargs))
        return cls(opcode=words[D_OPCODE], args=args, node=words[D_NODE], param_mask=words[D_PARAM_MASK],
                   signal=words[D_SIGNAL], waits=waits)


def split64(value: int) -> list[int]:
    """An int64 as (low, high) int32 words, the way little-endian memory holds it."""
    value &= (1 << 64) - 1
    return [to_i32(value & 0xFFFFFFFF), to_i32(value >> 32)]


def join64(low: int, high: int) -> int:
    value = (low & 0xFFFFFFFF) | ((high & 0xFFFFFFFF) << 32)
    return value - (1 << 64) if value >= 1 << 63 else value


def to_i32(value: int) -> int:
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def fp32_bits(value: float) -> int:
    """The bit pattern of an fp32, as a (signed) int32 slot value."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def bits_fp32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<i", to_i32(bits)))[0]
