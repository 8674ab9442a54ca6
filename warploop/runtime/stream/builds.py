"""Placed streaming programs (StreamProgram.build's result), and a folder that keeps them for the
next start: one compressed file a program of what the executor uploads (the instruction words,
the CTA table, the counter sizes), named by a hash of the program and of the code that places and
checks it, so a server's later start of the same shape skips placement."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from warploop.runtime.placement import Schedule
from warploop.runtime.stream.kinds import WORDS, Instruction


@dataclasses.dataclass(frozen=True)
class Built:
    """A placed program. One read from a build cache (StreamProgram.build's `cache`) carries only
    what the executor uploads: no schedule, no instructions."""
    schedule: Schedule | None
    words: np.ndarray             # int32 [instructions * WORDS], CTA by CTA
    table: np.ndarray             # int32 [2 * ctas]: (first instruction, count) per CTA
    counters: int                 # counters the program uses
    instructions: tuple[Instruction, ...]
    counter_sizes: tuple[int, ...] = ()   # signals per run, per counter (the loop's back edge included)

    @property
    def instruction_count(self) -> int:
        return self.words.size // WORDS - 1          # the words end with one NOP past the last instruction


# the modules whose code decides what a build holds and whether it is checked (a cached build's key)
_BUILD_CODE = ("warploop.runtime.placement", "warploop.runtime.descriptor", "warploop.runtime.stream.kinds",
               "warploop.runtime.stream.hazards", "warploop.runtime.stream.compiled",
               "warploop.runtime.stream.program", __name__)


def build_key(program, ctas: int) -> str:
    """A hash of what build reads (the config, the CTAs, every node's kind, words, deps and pin,
    the loop, the tickets) and of the modules whose code builds and checks it."""
    h = hashlib.sha256()
    for module in _BUILD_CODE:
        h.update(Path(sys.modules[module].__file__).read_bytes())
    h.update(repr((program.config, ctas, program.loop, program.tickets)).encode())
    dep_ids: dict[int, int] = {}             # a stage's tiles share one deps tuple: hash it once
    distinct = []
    index = []
    for n in program.nodes:
        k = dep_ids.get(id(n.deps))
        if k is None:
            k = dep_ids[id(n.deps)] = len(distinct)
            distinct.append(n.deps)
        index.append((n.kind.opcode, k, n.worker, n.body))
    h.update(repr(distinct).encode())
    h.update(repr(index).encode())
    return h.hexdigest()[:32]


def read_built(path: Path) -> tuple[Built | None, bool]:
    """(a cached build, whether it was hazard-checked), or (None, False) when there is none or it
    cannot be read."""
    try:
        with np.load(path, allow_pickle=False) as z:
            words, table, sizes, meta = z["words"], z["table"], z["sizes"], z["meta"]
    except (OSError, KeyError, ValueError, EOFError):
        return None, False
    if words.dtype != np.int32 or table.dtype != np.int32 or words.size % WORDS or meta.shape != (2,):
        return None, False
    return Built(None, words, table, int(meta[0]), (), tuple(int(v) for v in sizes)), bool(meta[1])


def write_built(path: Path, built: Built, checked: bool) -> None:
    """Write a build for the next start; a folder that cannot be written costs only that."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")
        np.savez_compressed(tmp, words=built.words, table=built.table,
                            sizes=np.asarray(built.counter_sizes, dtype=np.int64),
                            meta=np.asarray([built.counters, int(checked)], dtype=np.int64))
        os.replace(tmp, path)                   # a reader sees the old file or the whole new one
    except OSError:
        pass
