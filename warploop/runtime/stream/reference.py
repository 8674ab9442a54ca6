"""The CPU executor of a streaming program: every node in recording order, in PyTorch, float32.

This is the reference a GPU run is diffed against, node by node (`node_outputs`), the way
Megakernels checks its CUDA against its python_vm. Each kind's body reads the same declared
fields the Gluon kernel reads.
"""
from __future__ import annotations

import threading
import time

from warploop.runtime.stream import philox
from warploop.runtime.stream.kinds import (
    ALLREDUCE,
    ATTN,
    CAST,
    EMBED,
    EPILOGUES,
    GEMV,
    NOP,
    SAMP_WORDS,
    SAMPLE,
    tile_pool_rows,
    tile_rows,
)


class ExchangeTimeout(RuntimeError):
    """A rank waited longer than the exchange's timeout for the others' partials."""


class Exchange:
    """The CPU reference's all-reduce among `world` ranks run in threads of one process: each
    rank's n-th call hands in its tensor and gets every rank's n-th, in rank order (ranks make the
    same calls in the same order, as their programs have one shape). A rank that waits longer than
    `timeout` seconds gets ExchangeTimeout, and so does every later call of the exchange: one rank
    failing must not leave the others waiting.

        ex = Exchange(2)
        ex.rank(0).gather(t0)  # in rank 0's thread -> [t0, t1]; rank(1).gather(t1) in rank 1's
    """

    def __init__(self, world: int, timeout: float = 60.0) -> None:
        if world < 1:
            raise ValueError(f"an exchange needs at least one rank, not {world}")
        self.world, self.timeout = world, timeout
        self._cv = threading.Condition()
        self._calls = [0] * world
        self._posted: dict[int, dict[int, object]] = {}     # call number -> rank -> its tensor
        self._taken: dict[int, int] = {}
        self.failed: str | None = None

    def rank(self, r: int) -> RankExchange:
        if not 0 <= r < self.world:
            raise ValueError(f"rank {r} is outside [0, {self.world})")
        return RankExchange(self, r)

    def _gather(self, r: int, tensor) -> list:
        deadline = time.monotonic() + self.timeout
        with self._cv:
            n = self._calls[r]
            self._calls[r] += 1
            self._posted.setdefault(n, {})[r] = tensor.clone()
            self._cv.notify_all()
            while len(self._posted[n]) < self.world and self.failed is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.failed = (f"rank {r} waited {self.timeout:.0f} s at all-reduce {n} for ranks "
                                   f"{sorted(set(range(self.world)) - set(self._posted[n]))}")
                    self._cv.notify_all()
                    break
                self._cv.wait(left)
            if self.failed is not None:
                raise ExchangeTimeout(self.failed)
            parts = [self._posted[n][q] for q in range(self.world)]
            self._taken[n] = self._taken.get(n, 0) + 1
            if self._taken[n] == self.world:        # every rank has its copy: the call's slot goes
                del self._posted[n], self._taken[n]
            return parts


class RankExchange:
    """One rank's side of an Exchange (what reference() and run_node take)."""

    def __init__(self, exchange: Exchange, rank: int) -> None:
        self.exchange, self.rank = exchange, rank

    @property
    def world(self) -> int:
        return self.exchange.world

    def gather(self, tensor) -> list:
        return self.exchange._gather(self.rank, tensor)


def _rope(x, c, s, w, eps):
    """Rows x [R, hd]: RMS-normed by w (when given), then rotated by the halves convention."""
    import torch
    if w is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def run_attention(program, arena, ints, kv, f, s: int = 0) -> None:
    import torch
    hd, g, grp, heads, kvh = f["hd"], f["kvhead"], f["group"], f["heads"], f["kvheads"]
    pos, n_ctx, write = (int(v) for v in ints[f["step"]:f["step"] + 3])
    pos, n_ctx = pos + s, n_ctx + s                          # step s of a launch
    half = hd // 2
    x = arena[f["qkv"]:f["qkv"] + (heads + 2 * kvh) * hd].view(heads + 2 * kvh, hd)
    c = arena[f["cos"] + pos * half:f["cos"] + (pos + 1) * half]
    s = arena[f["sin"] + pos * half:f["sin"] + (pos + 1) * half]
    vec = lambda off: None if off < 0 else arena[off:off + hd]
    q = _rope(x[f["head"]:f["head"] + grp], c, s, vec(f["qn"]), f["eps"])
    k = _rope(x[heads + g:heads + g + 1], c, s, vec(f["kn"]), f["eps"])[0].to(torch.bfloat16)
    v = x[heads + kvh + g].to(torch.bfloat16)
    cache = kv[f["layer"]]                                    # [2, blocks, bs, kvh, hd]
    bs = cache.shape[2]
    slot = int(ints[f["step"] + 3 + pos // bs]) * bs + pos % bs
    if write >= 0:
        cache[0, slot // bs, slot % bs, g] = k
        cache[1, slot // bs, slot % bs, g] = v
    if n_ctx == 0:                  # an idle row: its one share is empty (splits 1: the kernel's 0 / 0)
        if f["splits"] == 1:
            _attn_out(arena, f, torch.full((grp * hd,), float("nan")))
        return
    toks = torch.arange(n_ctx)
    table = ints[f["step"] + 3:f["step"] + 3 + (n_ctx + bs - 1) // bs].long().to(kv.device)
    blk = table[toks // bs]
    keys = cache[0, blk, toks % bs, g].float()
    vals = cache[1, blk, toks % bs, g].float()
    keys[n_ctx - 1], vals[n_ctx - 1] = k.float(), v.float()   # the new token as computed, slot or not
    wg = program.config.attn_wgmma              # q and each chunk's probabilities as bf16 (wgmma's operands)
    if wg:
        q = q.to(torch.bfloat16).float()
    sc = (q @ keys.T) * f["scale"]
    tile = program.config.kv_tokens
    cdiv = lambda a, b: -(-a // b)
    chunk = cdiv(cdiv(n_ctx, f["splits"]), tile) * tile          # the kernel's shares: whole tiles
    lo = min(f["split"] * chunk, n_ctx)                        # one split: the whole context
    hi = min(lo + chunk, n_ctx)
    if f["splits"] == 1 and not wg:
        _attn_out(arena, f, (torch.softmax(sc, dim=-1) @ vals).reshape(-1))
        return
    if hi <= lo:                                # a share past the context writes nothing
        return
    if wg:                                      # online, a ring chunk at a time, as the kernel
        m = torch.full((grp,), float("-inf"), device=sc.device)
        acc, l = torch.zeros(grp, hd, device=sc.device), torch.zeros(grp, device=sc.device)
        for t in range(lo, hi, tile):
            st = sc[:, t:min(t + tile, hi)]
            m_new = torch.maximum(m, st.max(-1).values)
            e, alpha = torch.exp(st - m_new[:, None]), torch.exp(m - m_new)
            acc = acc * alpha[:, None] + e.to(torch.bfloat16).float() @ vals[t:t + st.shape[1]]
            l, m = l * alpha + e.sum(-1), m_new
        if f["splits"] == 1:
            _attn_out(arena, f, (acc / l[:, None]).reshape(-1))
            return
    else:
        m = sc[:, lo:hi].max(-1).values
        e = torch.exp(sc[:, lo:hi] - m[:, None])
        acc, l = e @ vals[lo:hi], e.sum(-1)
    base = f["part"] + f["split"] * grp * (hd + 2)
    arena[base:base + grp * hd] = acc.reshape(-1)
    arena[base + grp * hd:base + grp * hd + grp] = m
    arena[base + grp * hd + grp:base + grp * (hd + 2)] = l
    live = min(f["splits"], cdiv(n_ctx, chunk))   # the shares holding tokens
    if f["split"] == live - 1:                  # the last of them (nodes run in order) merges them
        merge_shares(arena, f, live)


def merge_shares(arena, f, splits: int) -> None:
    """The first `splits` shares' partials of a KV head into its q heads' rows of out."""
    import torch
    hd, grp = f["hd"], f["group"]
    parts = arena[f["part"]:f["part"] + splits * grp * (hd + 2)].view(splits, grp * (hd + 2))
    acc = parts[:, :grp * hd].view(splits, grp, hd)
    m, l = parts[:, grp * hd:grp * hd + grp], parts[:, grp * hd + grp:]
    w = torch.exp(m - m.max(0).values)
    _attn_out(arena, f, ((acc * w[:, :, None]).sum(0) / (l * w).sum(0)[:, None]).reshape(-1))


def _attn_out(arena, f, values) -> None:
    """An ATTN node's q heads' rows of out: fp32, or with obf bf16 from element 2 * out."""
    import torch
    at = f["head"] * f["hd"]
    if f["obf"]:
        bf16_view(arena)[2 * f["out"] + at:2 * f["out"] + at + values.numel()] = values.to(torch.bfloat16)
    else:
        arena[f["out"] + at:f["out"] + at + values.numel()] = values.to(arena.device)


def run_node(program, arena, node, ints=None, kv=None, s: int = 0, exchange: RankExchange | None = None,
             normed: dict | None = None) -> None:
    """Node `node` of step s of a launch (a decode loop's step; 0 for a single run). exchange: this
    rank's side of the ranks' Exchange, for a tensor-parallel program's all-reduce nodes.

    normed: kept between the nodes of one run (reference() passes it): a GEMV's normed input and
    its scale, which every tile of its stage would otherwise compute again, until a node writes
    where that input or its norm weights lie."""
    if node.kind is NOP:
        return
    if normed and node.kind is not GEMV and node.kind is not SAMPLE:     # SAMPLE writes ints only
        normed.clear()
    if node.kind is ALLREDUCE:
        f = node.fields
        if exchange is None or exchange.world != f["world"]:
            raise ValueError(f"node {node.index} all-reduces over {f['world']} ranks: run it with their exchange "
                             f"(reference(..., exchange=Exchange({f['world']}).rank(r)))")
        parts = exchange.gather(arena[f["src"]:f["src"] + f["n"]])
        total = parts[0].clone()
        for part in parts[1:]:                  # rank order: every rank adds the same way
            total += part
        if f["epi"] == EPILOGUES["add"]:
            total += arena[f["out"]:f["out"] + f["n"]]
        arena[f["out"]:f["out"] + f["n"]] = total
        return
    if node.kind is ATTN:
        run_attention(program, arena, ints, kv, node.fields, s)
        return
    f = node.fields
    if node.kind is EMBED:
        local = int(ints[f["token"]]) - f["first"]
        if f["shard"] and not 0 <= local < f["rows"]:   # another rank's token: its row comes from there
            arena[f["out"]:f["out"] + f["k"]] = 0.0
            return
        row = min(max(local, 0), f["rows"] - 1)
        arena[f["out"]:f["out"] + f["k"]] = program.emb[row].float().to(arena.device)
        return
    if node.kind is CAST:
        import torch
        x = arena[f["x"]:f["x"] + f["k"]]
        if f["parts"]:                      # a split-K GEMV's partial sums, in split order, into x
            x = x.clone()
            for p in range(f["parts"]):
                at = f["part"] + p * f["pstride"]
                x += arena[at:at + f["k"]]
            arena[f["x"]:f["x"] + f["k"]] = x
        if f["norm"] >= 0:
            x = x * torch.rsqrt(x.pow(2).mean() + f["eps"]) * arena[f["norm"]:f["norm"] + f["k"]]
        bf16_view(arena)[2 * f["out"]:2 * f["out"] + f["k"]] = x.to(torch.bfloat16)
        return
    if node.kind is SAMPLE:
        pairs = arena[f["pairs"]:f["pairs"] + 2 * f["count"]].view(-1, 2)
        best = int(pairs[:, 0].argmax())    # the first of equal maxima: the lowest token, as the kernel
        rank = best // f["per"] if f["per"] else 0
        ints[f["token"]] = ints[f["tokens"] + s] = int(pairs[best, 1]) - f["base"] + rank * f["shard"]
        return
    if node.kind is not GEMV:
        raise NotImplementedError(f"the reference has no body for kind {node.kind.name}")
    import torch
    f = node.fields
    br = tile_rows(f, program.config.block_rows)
    k, batch, xk, col = f["k"], f["batch"], f["xk"], f["col"]
    key = (f["x"], ((batch - 1) * xk + k) // (2 if f["xbf"] else 1), f["norm"], k, f["eps"])
    kept = None if normed is None else normed.get(key)
    if kept is None:
        if f["xbf"]:                    # CAST nodes' bf16 rows, normalised already (a split-K tile's columns)
            rows = bf16_view(arena)[2 * f["x"]:2 * f["x"] + batch * xk].float()
            xs, scale = torch.nn.functional.pad(rows, (0, batch * xk - rows.numel())).view(batch, xk)[:, :k], 1.0
        else:
            xs = arena[f["x"]:f["x"] + batch * k].view(batch, k)
            scale = 1.0
            if f["norm"] >= 0:
                scale = torch.rsqrt(xs.pow(2).mean(-1, keepdim=True) + f["eps"])
                xs = xs * arena[f["norm"]:f["norm"] + k]
        if normed is not None:
            normed.clear()
            normed[key] = (xs, scale)
    else:
        xs, scale = kept
    if normed:
        _forget_written(normed, GEMV.footprint(f, program.config.block_rows)[1])
    pool = program.pools[f["pool"]]
    ys = []
    for first, count in tile_pool_rows(f, program.config.block_rows):
        y = xs @ pool[first:first + count, col:col + k].float().to(arena.device).T         # [batch, rows]
        if y.shape[1] < count:                  # rows past the pool: zeros (TMA)
            y = torch.cat([y, y.new_zeros(batch, count - y.shape[1])], 1)
        ys.append(y)
    ys = (ys[0] if len(ys) == 1 else torch.cat(ys, 1)) * scale
    n = f["rows"]
    for b in range(batch):
        y, out = ys[b], f["out"] + b * f["ostride"]
        if f["obf"]:                            # bf16 outputs (kinds.GEMV obf): no bias, add or amax
            at = 2 * f["out"] + b * f["ostride"]
            if f["epi"] == EPILOGUES["silu_mul"]:
                y = torch.nn.functional.silu(y[:br // 2]) * y[br // 2:]
            bf16_view(arena)[at:at + n] = y[:n].to(torch.bfloat16)
            continue
        if f["epi"] == EPILOGUES["silu_mul"]:
            g, u = y[:br // 2], y[br // 2:]
            arena[out:out + n] = (torch.nn.functional.silu(g) * u)[:n]
            continue
        y = y[:n]
        if f["bias"] >= 0:
            y = y + arena[f["bias"]:f["bias"] + n]
        if f["epi"] == EPILOGUES["add"]:
            y = y + arena[out:out + n]
        arena[out:out + n] = y
        if f["amax"] >= 0:                      # the largest output (or race value) and its arena offset
            y = _raced(y, f, out, ints, s)
            best, at = int(y.argmax()), f["amax"] + b * f["astride"]
            arena[at] = y[best]
            arena[at + 1] = float(out + best)


def bf16_view(arena):
    """The fp32 arena's words as bf16 pairs (element 2w is word w's low half): CAST's output, an
    xbf GEMV's input."""
    import torch
    return arena.view(torch.bfloat16)


def _forget_written(normed: dict, writes: list) -> None:
    """Drop the kept input if a GEMV node's writes (its footprint's) overlap that input or its norm
    weights (its own values were read before; the next node's would not be)."""
    for x, xn, norm, k, _ in list(normed):
        if any(o < x + xn and x < o + n or norm >= 0 and o < norm + k and norm < o + n for o, n in writes):
            normed.clear()
            return


def _raced(y, f, out: int, ints, s: int):
    """A sampled row's race values y / T + G (kinds.GEMV "samp"); y itself for greedy rows."""
    if f["samp"] < 0:
        return y
    import numpy as np
    import torch
    w = [int(v) for v in ints[f["samp"]:f["samp"] + len(SAMP_WORDS)]]
    temperature = float(np.int32(w[0]).view(np.float32))
    if temperature <= 0:
        return y
    seed = (w[1] & 0xFFFFFFFF) | (w[2] & 0xFFFFFFFF) << 32
    tokens = np.arange(out, out + y.shape[0]) + w[4]
    noise = torch.from_numpy(philox.gumbel(seed, w[3] + s, tokens)).to(y.device)
    return y / temperature + noise


def reference(program, arena=None, ints=None, kv=None, steps: int = 1, exchange: RankExchange | None = None):
    """Run every node of `program`, `steps` times (a decode loop's steps), on a copy of `arena`
    (default: program.arena() on the CPU), on the arena's device; return the copy. Attention and
    sampling read and write `ints` (default: program.int_arena()) and attention writes `kv`, in
    place (default: a copy of program.kv). exchange: this rank's side of the ranks' Exchange (a
    tensor-parallel program, each rank's reference in its own thread)."""
    arena = program.arena() if arena is None else arena.detach().clone()
    given = program.int_arena() if ints is None else ints
    ints = given.cpu()
    if kv is None and program.kv is not None:
        kv = program.kv.detach().clone()
    normed: dict = {}
    for s in range(steps):
        for node in program.nodes:
            run_node(program, arena, node, ints, kv, s, exchange, normed)
    if ints is not given:
        given.copy_(ints)
    return arena


def first_difference(program, got, want, rtol: float = 1e-3, start=None) -> str | None:
    """The first node whose output differs between two arenas by more than rtol relative to the
    largest reference value of that output (None: every node agrees). start: the arena both runs
    began from; where it held NaN (a poisoned output) and both runs left it so, neither wrote it
    (an attention share past the context writes no partials), and that agrees."""
    import torch
    br = program.config.block_rows
    for n in program.nodes:
        for off, ln in n.kind.footprint(n.fields, br)[1]:
            a, b = got[off:off + ln].float().cpu(), want[off:off + ln].float().cpu()
            finite = b[b.isfinite()]
            scale = max(finite.abs().max().item() if finite.numel() else 0.0, 1e-30)
            # equal values (an empty attention split's -inf running max too) differ by nothing
            same = a == b
            if start is not None:
                same |= start[off:off + ln].float().cpu().isnan() & a.isnan() & b.isnan()
            err = torch.where(same, 0.0, (a - b).abs()).max().item() / scale
            if not err <= rtol:            # NaN fails too
                return f"node {n.index} ({n.kind.name}, fields {n.fields}): relative error {err:.3g} > {rtol}"
    return None
