"""The streaming program's hazard check: any run of the graph computes what running its nodes in
recording order does.

Every arena range a node writes must be ordered (ancestor or descendant) against every node that
reads or writes it; `check_hazards` refuses a program where it is not, naming the two nodes.
"""
from __future__ import annotations


class HazardError(ValueError):
    pass


def check_hazards(program) -> None:
    """Raise HazardError naming two nodes that touch one arena float, one of them writing it, with
    neither an ancestor of the other. A sweep over the arena's boundaries keeps the readers and
    writers of the current segment as bitsets, so the check is a few big-integer operations per
    segment and writer, not one per pair of nodes."""
    nodes, br = program.nodes, program.config.block_rows
    anc, desc = ancestry(nodes)
    points: dict[int, list] = {}                 # arena offset -> [(delta, node, writes)]
    for n in nodes:
        reads, writes = n.kind.footprint(n.fields, br)
        for (s, ln), w in [(r, False) for r in reads] + [(r, True) for r in writes]:
            if ln > 0:
                points.setdefault(s, []).append((1, n.index, w))
                points.setdefault(s + ln, []).append((-1, n.index, w))
    count = {False: {}, True: {}}
    bits = {False: 0, True: 0}
    for at in sorted(points):
        for delta, i, w in points[at]:
            c = count[w][i] = count[w].get(i, 0) + delta
            if c == 0:
                bits[w] &= ~(1 << i)
            elif c == 1 and delta == 1:
                bits[w] |= 1 << i
        writers, touched = bits[True], bits[True] | bits[False]
        while writers:
            i = (writers & -writers).bit_length() - 1
            writers &= writers - 1
            loose = touched & ~(anc[i] | desc[i] | (1 << i))
            if loose:
                j = (loose & -loose).bit_length() - 1
                a, b = sorted((i, j))
                raise HazardError(f"nodes {a} ({nodes[a].kind.name}) and {b} ({nodes[b].kind.name}) both touch "
                                  f"arena offset {at} and one writes it, but neither depends on the other")


def ancestry(nodes) -> tuple[list[int], list[int]]:
    """Each node's ancestors and descendants as bitsets (bit j: node j), for nodes in recording order
    (each with .index and .deps, its dependencies recorded earlier)."""
    anc, desc = [0] * len(nodes), [0] * len(nodes)
    # Nodes with one deps tuple (a stage's tiles) have one set of ancestors, and reach their
    # dependencies as one class: each is worked out once per tuple, not once per node and edge.
    shared: dict[tuple[int, ...], int] = {}
    lowest: dict[tuple[int, ...], int] = {}      # a class's first member: its pushes wait for it
    for n in nodes:
        a = shared.get(n.deps)
        if a is None:
            a = 0
            for d in n.deps:
                a |= anc[d] | (1 << d)
            shared[n.deps] = a
            lowest[n.deps] = n.index
        anc[n.index] = a
    below: dict[tuple[int, ...], int] = {}       # a class's members and their descendants, so far
    for n in reversed(nodes):
        if not n.deps:
            continue
        u = below.get(n.deps, 0) | desc[n.index] | (1 << n.index)
        below[n.deps] = u
        if lowest[n.deps] == n.index:           # every member is done: its dependencies get them all
            for d in n.deps:
                desc[d] |= u
    return anc, desc
