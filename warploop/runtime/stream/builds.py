"""Placing a streaming program (StreamProgram.build): its nodes on the CTAs (runtime/placement.py),
the counters build adds after placement's, every CTA's instructions as words; and a folder that
keeps the placed programs for the next start: one compressed file a program of what the executor
uploads (the instruction words, the CTA table, the counter sizes), named by a hash of the program
and of the code that places and checks it, so a server's later start of the same shape skips
placement."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from warploop.runtime.placement import NodeSpec, Schedule, place
from warploop.runtime.stream.hazards import check_hazards
from warploop.runtime.stream.kinds import ALLREDUCE, ATTN, EMBED, HEADER, MAX_WAITS, NOP, SAMPLE, WORDS, Instruction


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
               "warploop.runtime.stream.hazards", "warploop.runtime.ancestry", "warploop.runtime.stream.compiled",
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


def build_program(program, ctas: int, check: bool = True, cache: str | os.PathLike | None = None) -> Built:
    """StreamProgram.build: `program` placed on `ctas` CTAs, every CTA's instructions encoded,
    read from or written to the folder `cache` (see there)."""
    if not program.nodes:
        raise ValueError("a program needs at least one node")
    path = None
    if cache is not None:
        path = Path(cache) / f"stream-{build_key(program, ctas)}.npz"
        built, checked = read_built(path)
        if built is not None:
            if check and not checked:
                check_hazards(program)
                write_built(path, built, True)
            return built
    built = _build(program, ctas, check)
    if path is not None:
        write_built(path, built, check)
    return built


def _build(program, ctas: int, check: bool) -> Built:
    if check:
        check_hazards(program)
    br = program.config.block_rows
    sched = place([NodeSpec(n.deps, n.kind.cost(n.fields, br), n.worker) for n in program.nodes], ctas)
    counts = np.array([len(lst) for lst in sched.lists], dtype=np.int32)
    table = np.stack([np.cumsum(counts) - counts, counts], 1).astype(np.int32).reshape(-1)
    sizes = sched.counter_sizes
    # the counters build adds after placement's: each back edge of the loop (one signal a run),
    # each merge ticket, each all-reduce slice (signalled by its peers)
    backs = {}
    for sample, embed in program.loop or ():
        backs[sample] = backs[embed] = len(sizes)
        sizes = sizes + (1,)
    tickets, meets = len(sizes), len(sizes) + len(program.tickets)
    sizes = sizes + tuple(program.tickets) + tuple(w - 1 for w in program.meets)
    insts = []
    for lst in sched.lists:
        for i, waits, signal, signals in _runs_merged(lst):
            if i < 0:
                insts.append(Instruction(NOP, waits, -1))
                continue
            n = program.nodes[i]
            fields = n.fields
            if n.kind is SAMPLE and i in backs:
                signal, signals = backs[i], 1
            elif n.kind is EMBED and i in backs:
                waits = waits + ((backs[i], -1),)
            elif n.kind is ATTN and fields["ticket"] >= 0:
                fields = {**fields, "ticket": tickets + fields["ticket"]}
            elif n.kind is ALLREDUCE:
                fields = {**fields, "meet": meets + fields["meet"]}
            insts.append(Instruction(n.kind, waits, signal, fields, signals))
    return Built(sched, _words(insts, program.nodes, [i.node for lst in sched.lists for i in lst]), table,
                 len(sizes), tuple(insts), sizes)


def _runs_merged(lst):
    """A CTA's consecutive instructions with the same waits and the same counter (tiles of one
    stage): only the first waits, and only the last signals, by the run's length. Nothing in the
    run waits on anything else, so holding its signals back cannot deadlock. Yields each Inst's
    (node, waits, signal, signals)."""
    i = 0
    while i < len(lst):
        head = lst[i]
        j = i
        if head.node >= 0:
            while j + 1 < len(lst) and lst[j + 1].node >= 0 and lst[j + 1].signal == head.signal \
                    and lst[j + 1].waits == head.waits:
                j += 1
        last = j - i + 1 if head.signal >= 0 else 1
        for m in range(i, j + 1):
            yield lst[m].node, head.waits if m == i else (), head.signal if m == j else -1, last if m == j else 1
        i = j + 1


def _words(insts: list[Instruction], nodes: list, node_of: list[int]) -> np.ndarray:
    """The instructions' words (Instruction.serialize's, row by row), and one NOP's past the last:
    a CTA with no instructions reads its first (unused) words there, inside the array. Each row's
    fields are its node's, encoded when the node was added (program.Node.body), but for a merge ticket's or
    an all-reduce slice's counter, which build numbered: those words are set here."""
    words = np.zeros((len(insts) + 1, WORDS), dtype=np.int32)
    head, rows, kinds = [], {}, {}
    for r, inst in enumerate(insts):
        if len(inst.waits) > MAX_WAITS:
            raise ValueError(f"an instruction holds at most {MAX_WAITS} waits (the builder adds NOPs for more)")
        w = inst.waits + ((-1, 0),) * (MAX_WAITS - len(inst.waits))
        head.append((inst.kind.opcode, w[0][0], w[0][1], w[1][0], w[1][1], inst.signal, inst.signals))
        rows.setdefault(id(inst.kind), []).append(r)       # by identity: a kind hashes all its fields
        kinds[id(inst.kind)] = inst.kind
    words[:-1, :len(HEADER)] = head
    for k, at in rows.items():
        kind = kinds[k]
        if kind.fields:
            words[at, len(HEADER):len(HEADER) + len(kind.fields)] = [nodes[node_of[r]].body for r in at]
        name = "ticket" if kind is ATTN else "meet" if kind is ALLREDUCE else None
        if name:
            words[at, kind.word(name)] = [insts[r].fields[name] for r in at]
    return words.reshape(-1)
