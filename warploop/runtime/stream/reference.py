"""The CPU executor of a streaming program: every node in recording order, in PyTorch, float32.

This is the reference a GPU run is diffed against, node by node (`node_outputs`), the way
Megakernels checks its CUDA against its python_vm. Each kind's body reads the same declared
fields the Gluon kernel reads.
"""
from __future__ import annotations

from warploop.runtime.stream.kinds import EPILOGUES, GEMV, NOP


def run_node(program, arena, node) -> None:
    if node.kind is NOP:
        return
    if node.kind is not GEMV:
        raise NotImplementedError(f"the reference has no body for kind {node.kind.name}")
    import torch
    f, br = node.fields, program.config.block_rows
    k = f["k"]
    x = arena[f["x"]:f["x"] + k]
    if f["norm"] >= 0:
        x = x * torch.rsqrt(x.pow(2).mean() + f["eps"]) * arena[f["norm"]:f["norm"] + k]
    w = program.pools[f["pool"]][f["row"]:f["row"] + br, :k].float().to(arena.device)
    y = w @ x
    if y.shape[0] < br:                          # a tile past the pool's last row reads zeros (TMA)
        y = torch.cat([y, y.new_zeros(br - y.shape[0])])
    n, out = f["rows"], f["out"]
    if f["epi"] == EPILOGUES["silu_mul"]:
        g, u = y[:br // 2], y[br // 2:]
        arena[out:out + n] = (torch.nn.functional.silu(g) * u)[:n]
        return
    y = y[:n]
    if f["bias"] >= 0:
        y = y + arena[f["bias"]:f["bias"] + n]
    if f["epi"] == EPILOGUES["add"]:
        y = y + arena[out:out + n]
    arena[out:out + n] = y


def reference(program, arena=None):
    """Run every node of `program` on a copy of `arena` (default: program.arena() on the CPU), on
    the arena's device; return the copy."""
    arena = program.arena() if arena is None else arena.detach().clone()
    for node in program.nodes:
        run_node(program, arena, node)
    return arena


def first_difference(program, got, want, rtol: float = 1e-3) -> str | None:
    """The first node whose output differs between two arenas by more than rtol relative to the
    largest reference value of that output (None: every node agrees)."""
    br = program.config.block_rows
    for n in program.nodes:
        for off, ln in n.kind.footprint(n.fields, br)[1]:
            a, b = got[off:off + ln].float().cpu(), want[off:off + ln].float().cpu()
            scale = max(b.abs().max().item(), 1e-30)
            err = (a - b).abs().max().item() / scale
            if not err <= rtol:            # NaN fails too
                return f"node {n.index} ({n.kind.name}, fields {n.fields}): relative error {err:.3g} > {rtol}"
    return None
