"""The streaming program's hazard check: any run of the graph computes what running its nodes in
recording order does.

Every arena range a node writes must be ordered (ancestor or descendant) against every node that
reads or writes it; `check_hazards` refuses a program where it is not, naming the two nodes.
"""
from __future__ import annotations

import numpy as np

from warploop.runtime.ancestry import ancestors


class HazardError(ValueError):
    pass


def check_hazards(program) -> None:
    """Raise HazardError naming two nodes that touch one arena float, one of them writing it, with
    neither an ancestor of the other: at the lowest such float's segment (the arena cut at every
    range's ends), the lowest writer that has such a partner, and its lowest partner.

    Two nodes i < j are ordered exactly when i is an ancestor of j (recording order is
    topological), and j's ancestors are its class's (its deps tuple's). Along one float the nodes
    touching it, in index order, must then alternate writers and runs of readers, each writer an
    ancestor of everything up to and including the next writer, and everything since the writer
    before an ancestor of it: by transitivity every writer is then ordered against every other node
    there. So each segment needs only its touches sorted by node and, for each, a test against the
    writer before and after it; readers of one range in one class with consecutive indices (a
    stage's tiles reading its input) are one touch, and a run of them an ancestor of a writer when
    one run of that writer's class's ancestors holds it. All of it is array work; the naming then
    looks at the one segment found."""
    nodes, br = program.nodes, program.config.block_rows
    cls, anc = ancestors([n.deps for n in nodes])
    flat, counts = [], []                        # every range, and each node's number of reads, writes
    for n in nodes:
        reads, writes = n.kind.footprint(n.fields, br)
        flat += reads
        flat += writes
        counts += (len(reads), len(writes))
    if not flat:
        return
    ranges = np.asarray(flat, dtype=np.int64).reshape(-1, 2)
    owner = np.repeat(np.arange(len(nodes)).repeat(2), counts)
    writes = np.repeat(np.tile([False, True], len(nodes)), counts)
    keep = ranges[:, 1] > 0
    start, end, owner, writes = ranges[keep, 0], ranges[keep].sum(1), owner[keep], writes[keep]
    if not writes.any():
        return
    points = np.unique(np.concatenate([start, end]))
    klass = np.asarray(cls, dtype=np.int64)[owner]
    # the touches: a write a node; reads of one range by one class's consecutive nodes, one run
    order = np.lexsort((owner, klass, end, start, writes))
    s, e, o, w, c = start[order], end[order], owner[order], writes[order], klass[order]
    new = np.ones(len(o), dtype=bool)
    new[1:] = w[1:] | (s[1:] != s[:-1]) | (e[1:] != e[:-1]) | (c[1:] != c[:-1]) | (o[1:] - o[:-1] > 1)
    first = np.flatnonzero(new)
    lo, hi = o[first], np.maximum.reduceat(o, first)
    s, e, w, c = s[first], e[first], w[first], c[first]
    # each touch on each segment it covers
    a, b = np.searchsorted(points, s), np.searchsorted(points, e)
    seg = np.repeat(a - np.cumsum(b - a) + (b - a), b - a) + np.arange((b - a).sum())
    t = np.repeat(np.arange(len(s)), b - a)
    lo, hi, w, c = lo[t], hi[t], w[t], c[t]
    # a node's write there stands for its own read of it, and one write for its several
    key = seg * len(nodes) + lo
    drop = ~w & (lo == hi) & np.isin(key, key[w])
    seg, lo, hi, w, c = seg[~drop], lo[~drop], hi[~drop], w[~drop], c[~drop]
    order = np.lexsort((~w, lo, seg))             # by segment, then node; a writer before its read run
    seg, lo, hi, w, c = seg[order], lo[order], hi[order], w[order], c[order]
    dup = w & np.r_[False, w[:-1] & (seg[1:] == seg[:-1]) & (lo[1:] == lo[:-1])]
    seg, lo, hi, w, c = seg[~dup], lo[~dup], hi[~dup], w[~dup], c[~dup]
    here = np.arange(len(seg))
    seg_first = np.searchsorted(seg, seg)           # each touch's segment's first touch
    seg_last = np.searchsorted(seg, seg, "right") - 1
    before = np.maximum.accumulate(np.where(w, here, -1))
    before = np.r_[-1, before[:-1]]               # the writer before each touch in its segment
    after = np.minimum.accumulate(np.where(w, here, len(seg))[::-1])[::-1]
    after = np.r_[after[1:], len(seg)]           # and after it
    has_before, has_after = before >= seg_first, after <= seg_last
    runs = _Runs(anc, len(nodes))
    bad = np.zeros(len(seg), dtype=bool)
    p = before[has_before]
    bad[has_before] = ~runs.holds(c[has_before], lo[p], lo[p])
    q = after[has_after]
    bad[has_after] |= ~runs.holds(c[q], lo[has_after], hi[has_after])
    if bad.any():
        _name(nodes, cls, anc, start, end, owner, writes, int(points[seg[bad].min()]))


def _name(nodes, cls, anc, start, end, owner, writes, at: int) -> None:
    """Raise the HazardError of arena offset `at`, a segment's first float: its lowest writer with
    a partner it is not ordered against, and that writer's lowest partner."""
    there = (start <= at) & (end > at)
    touched = sorted(set(owner[there].tolist()))
    for i in sorted(set(owner[there & writes].tolist())):
        for j in touched:
            lo, hi = min(i, j), max(i, j)
            if j != i and not anc[cls[hi]] >> lo & 1:
                raise HazardError(f"nodes {lo} ({nodes[lo].kind.name}) and {hi} ({nodes[hi].kind.name}) both "
                                  f"touch arena offset {at} and one writes it, but neither depends on the other")


class _Runs:
    """Each class's ancestors as runs of consecutive nodes, to test many [lo, hi] at once."""

    def __init__(self, anc: list[int], n: int) -> None:
        self.stride = n + 1
        keys, ends = [np.array([-1])], [np.array([-1])]      # a run of no class: lo's run when its class has none
        for c, bits in enumerate(anc):
            b = np.unpackbits(np.frombuffer(bits.to_bytes((n + 7) // 8, "little"), np.uint8), bitorder="little")
            d = np.diff(b.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
            keys.append(c * self.stride + np.flatnonzero(d == 1))
            ends.append(np.flatnonzero(d == -1))
        self.keys, self.ends = np.concatenate(keys), np.concatenate(ends)

    def holds(self, c: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Whether class c[k]'s ancestors hold every node from lo[k] to hi[k], for every k."""
        k = np.searchsorted(self.keys, c * self.stride + lo, "right") - 1
        return (self.keys[k] >= c * self.stride) & (hi < self.ends[k])
