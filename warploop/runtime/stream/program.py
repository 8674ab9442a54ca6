"""A static program for the streaming executor: weight pools, an fp32 arena, nodes and their order.

    p = StreamProgram(StreamConfig())
    w = p.pool(torch.cat([wq, wo]))                  # [rows, K] bf16: what the loader streams
    x, y = p.buffer("x", 2048), p.buffer("y", 3072)
    a = p.gemv(w, 0, 3072, x, y, norm=p.buffer("n", 2048, init=norm_w), eps=1e-5)
    b = p.gemv(w, 3072, 2048, y, x, epi="add", after=a)
    built = p.build(ctas=132)                         # placement, counters, instruction words, hazard check
    out = reference(p)                                # the CPU executor (reference.py)

Nodes are recorded in a topological order (a node depends only on nodes recorded before it);
placement (runtime/placement.py, through builds.py) balances their cost over the CTAs and derives
the counters. Every arena range a node writes is ordered against every node that reads or writes it
(`check_hazards`), so any run of the graph computes what running the nodes in recording order does.
"""
from __future__ import annotations

import dataclasses
import os
from typing import NamedTuple

from warploop.runtime.stream.arena import Region, Space
from warploop.runtime.stream.builds import Built, build_program
from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.kinds import (
    ALLREDUCE,
    ATTN,
    CAST,
    EMBED,
    EPILOGUES,
    GEMV,
    HEADER,
    MAX_CAST_PARTS,
    SAMP_WORDS,
    SAMPLE,
    NodeKind,
)

MAX_POOLS = 4
ALLREDUCE_SLICE = 1024          # floats an all-reduce node sums (a hidden row of 2,048: two nodes)


@dataclasses.dataclass(frozen=True)
class Node:
    index: int
    kind: NodeKind
    fields: dict
    deps: tuple[int, ...]
    worker: int | None
    body: tuple[int, ...] = ()            # the fields as instruction words (kind.encode)


class StreamProgram:
    def __init__(self, config: StreamConfig | None = None) -> None:
        self.config = config or StreamConfig()
        self.pools: list = []
        self.floats = Space("float32", "buffer")     # the arena: activations, norms, biases, tables
        self.ints_space = Space("int32", "int buffer")  # the int arena: step words
        self.kv = None                           # the paged bf16 KV cache attention nodes use
        self.emb = None                          # the bf16 embedding table EMBED nodes read
        self.nodes: list[Node] = []
        self.loop: list[tuple[int, int]] | None = None   # (SAMPLE, EMBED) a row: the decode loop's back edges
        self.tickets: list[int] = []             # an attention merge ticket's shares (build gives each a counter)
        self.meets: list[int] = []               # an all-reduce slice's ranks (build gives each a counter)

    # -- memory ----------------------------------------------------------------------------------
    def buffer(self, name: str, size: int, init=None) -> Region:
        """An fp32 arena region of `size` floats (zeros, or `init`'s values)."""
        return self.floats.add(name, size, init)

    def ints(self, name: str, size: int, init=None) -> Region:
        """An int32 region of the int arena (an attention node's step words: pos, n_ctx, slot, table)."""
        return self.ints_space.add(name, size, init)

    @property
    def regions(self) -> dict[str, Region]:
        return self.floats.regions

    @property
    def int_regions(self) -> dict[str, Region]:
        return self.ints_space.regions

    def kv_cache(self, cache) -> None:
        """The paged KV cache, bf16 [layers, 2, blocks, block_size, kv_heads, head_dim] (KVCacheLayout)."""
        import torch
        if cache.dim() != 6 or cache.shape[1] != 2 or cache.dtype != torch.bfloat16 or not cache.is_contiguous():
            raise ValueError("the KV cache is a contiguous bfloat16 [layers, 2, blocks, block_size, kv_heads, "
                             f"head_dim] tensor, got {tuple(cache.shape)} {cache.dtype}")
        self.kv = cache

    def embedding(self, table) -> None:
        """The bf16 [vocab, hidden] table EMBED nodes read rows of."""
        import torch
        if table.dim() != 2 or table.dtype != torch.bfloat16 or not table.is_contiguous():
            raise ValueError(f"the embedding table is a contiguous 2-D bfloat16 matrix, got {tuple(table.shape)} "
                             f"{table.dtype}")
        if table.shape[1] > self.config.kmax:
            raise ValueError(f"an embedding row of {table.shape[1]} exceeds StreamConfig.kmax {self.config.kmax}")
        self.emb = table

    def pool(self, weights) -> int:
        """A [rows, K] bf16 matrix the loader streams rows of; returns its index."""
        import torch
        if len(self.pools) == MAX_POOLS:
            raise ValueError(f"a program takes at most {MAX_POOLS} weight pools (pack matrices of one width into one)")
        if weights.dim() != 2 or weights.dtype != torch.bfloat16 or not weights.is_contiguous():
            raise ValueError(f"a pool is a contiguous 2-D bfloat16 matrix, got {tuple(weights.shape)} {weights.dtype}")
        if weights.shape[1] % 8:
            raise ValueError(f"a pool's width must be a multiple of 8 (16-byte rows for TMA), got {weights.shape[1]}")
        if weights.shape[1] > self.config.kmax:
            raise ValueError(f"a pool of width {weights.shape[1]} exceeds StreamConfig.kmax {self.config.kmax}")
        self.pools.append(weights)
        return len(self.pools) - 1

    # -- nodes -----------------------------------------------------------------------------------
    def add(self, kind: NodeKind, after=(), worker: int | None = None, **fields) -> int:
        body = tuple(kind.encode(fields))         # names and int32 ranges, before anything is recorded
        deps = self._deps(after)
        self.nodes.append(Node(len(self.nodes), kind, dict(fields), deps, worker, body))
        return len(self.nodes) - 1

    def _deps(self, after) -> tuple[int, ...]:
        """`after` (node ids, nested lists of them) as a sorted tuple, checked: a stage's tiles share
        the one tuple this makes (a builder passes it on), not a copy each."""
        if isinstance(after, _Deps):
            return after.ids
        deps = tuple(sorted({int(d) for d in _flat(after)}))
        if deps and (deps[0] < 0 or deps[-1] >= len(self.nodes)):
            raise ValueError(f"node {len(self.nodes)} depends on {deps}: dependencies must be recorded earlier")
        return deps

    def gemv(self, pool: int, row: int, n: int, x: Region, out: Region, *, norm: Region | None = None,
             bias: Region | None = None, eps: float = 0.0, epi: str = "store", narrow: bool = False,
             amax: Region | None = None, up: int | None = None, batch: int = 1, after=(),
             worker: int | None = None, samp: Region | None = None, xbf: bool = False,
             obf: bool = False, splits: int = 1, tall: bool = False) -> list[int]:
        """out[:n] (=, +=) W[row:row + n] @ norm(x), as tiles of BR pool rows (narrow: BR/2, for a
        stage with fewer tiles than SMs). For "silu_mul", out[:n] = silu(W[row:row + n] @ norm(x)) *
        (W[up:up + n] @ norm(x)): the gate rows from `row`, the up rows from pool row `up`, BR/2 of
        each a tile. amax: a region of two floats a tile where each tile leaves its largest output
        and that output's offset (a SAMPLE node's pairs). batch: x holds that many rows of the
        pool's width one after another, out that many rows of n, amax that many rows of pairs.
        samp: an int region of kinds.SAMP_WORDS: the amax pairs of a sampled row (batch 1) race
        y / T + Gumbel noise (kinds.GEMV). xbf: x holds bf16 rows, normalised already (CAST nodes),
        batch * k / 2 floats. obf: out gets bf16 rows (batch * n / 2 floats), what a GEMV with xbf and
        no norm reads. splits: split K (an xbf store, not narrow, with no bias or amax): each tile's rows
        take `splits` tiles over consecutive runs of the pool's columns (a multiple of BK each, the last
        the rest; kinds.GEMV col, xk), split s storing its partial sums at out + s * batch * n (row b's at
        + b * n), which a CAST node's part adds (cast(), `splits` partials of stride batch * n). tall
        (StreamConfig.gemv_tall; not narrow or split): tiles of two ring slots a chunk (kinds.GEMV tall),
        2 BR rows a store's, BR outputs a silu_mul's."""
        br = self.config.block_rows
        if not 0 <= pool < len(self.pools):
            raise ValueError(f"pool {pool} does not exist ({len(self.pools)} pools)")
        if epi not in EPILOGUES:
            raise ValueError(f"epi must be one of {sorted(EPILOGUES)}, not {epi!r}")
        if batch < 1:
            raise ValueError(f"batch must be at least 1, not {batch}")
        if tall and not (self.config.gemv_tall and xbf and not narrow and splits == 1):
            raise ValueError("tall tiles take a kernel with StreamConfig.gemv_tall (wgmma tiles), a batched (xbf) "
                             "GEMV, not narrow and not split")
        per = (br if epi == "silu_mul" else 2 * br) if tall else br // 2 if epi == "silu_mul" or narrow else br
        tiles_n = -(-n // per)
        if amax is not None and (epi == "silu_mul" or amax.size < batch * 2 * tiles_n):
            raise ValueError("amax takes a store or add GEMV and two floats for each of its tiles, each row")
        if samp is not None and (amax is None or batch != 1 or samp.size < len(SAMP_WORDS)):
            raise ValueError(f"samp takes a GEMV with amax, of one row, and {len(SAMP_WORDS)} int words")
        if narrow and epi == "silu_mul":
            raise ValueError("a silu_mul tile cannot be narrow (its gate and up rows fill one tile)")
        if (epi == "silu_mul") != (up is not None):
            raise ValueError("up (the pool row of the up rows) is given for a silu_mul GEMV, and only there")
        w = self.pools[pool]
        k = int(w.shape[1])
        for first in (row, up) if up is not None else (row,):
            if n <= 0 or first < 0 or first + n > w.shape[0]:
                raise ValueError(f"rows [{first}, {first} + {n}) do not fit pool {pool} of {w.shape[0]} rows")
        if xbf and (norm is not None or k % 8 or x.size < batch * k // 2):
            raise ValueError(f"an xbf GEMV takes no norm (its CAST nodes normalised x), a width k a multiple of 8 "
                             f"(16-byte bf16 rows; pool {pool} is {k} wide) and x of batch * k / 2 floats")
        if xbf != bool(self.config.batch_rows):
            raise ValueError(f"xbf={xbf}: a {'batched' if self.config.batch_rows else 'batch-1'} kernel (StreamConfig."
                             f"batch_rows={self.config.batch_rows}) reads every GEMV's x as "
                             f"{'CAST nodes bf16 rows (xbf=True)' if self.config.batch_rows else 'fp32 (xbf=False)'}")
        if k % 4 or x.offset % 4 or (norm is not None and norm.offset % 4):
            raise ValueError(f"x (at {x.offset}), norm and the pool's width ({k}) must be multiples of 4 floats: the "
                             "kernel loads them 16 bytes at a time")
        if (not xbf and x.size < batch * k) or (norm is not None and norm.size < k):
            raise ValueError(f"x ({x.size}) must hold the pool's width {k} for each of {batch} row(s), and norm "
                             "must hold it once")
        if obf and (not xbf or epi == "add" or bias is not None or amax is not None or n % 2 or per % 2
                    or out.offset % 4):
            raise ValueError("an obf GEMV (bf16 outputs) is a batched kernel's store or silu_mul with no bias or "
                             "amax, an even n and tile, and out 16-byte aligned")
        if out.size < batch * n // (2 if obf else 1) or (bias is not None and bias.size < n):
            raise ValueError(f"out ({out.size}) must hold {n} rows for each of {batch} batch row(s)"
                             f"{' as bf16 (half a float each)' if obf else ''}, and bias {n} rows")
        if bias is not None and epi == "silu_mul":
            raise ValueError("silu_mul takes no bias")
        if splits < 1 or (splits > 1 and (not xbf or br != 64 or epi != "store" or narrow or obf or bias is not None
                                          or amax is not None or splits > -(-k // self.config.block_k))):
            raise ValueError(f"splits {splits}: split K takes a batched (xbf) kernel's 64-row tiles (the kernel's "
                             f"is {br}), a store GEMV with fp32 outputs, not narrow, with no bias or amax, and at "
                             f"most one split per {self.config.block_k} columns (k {k})")
        if splits > 1 and out.size < splits * batch * n:
            raise ValueError(f"out ({out.size}) must hold {splits} splits' partial sums of {batch} x {n}")
        bk = self.config.block_k
        width = ((k + splits - 1) // splits + bk - 1) // bk * bk     # a split's columns: a multiple of BK
        if -(-k // width) != splits:
            raise ValueError(f"splits {splits}: {k} columns in runs of {bk} make {-(-k // width)} splits of "
                             f"{width} (give that many)")
        tiles, after = [], _Deps(self._deps(after))
        count = -(-n // per)
        for col in range(0, k, width):
            at_out = out.offset + col // width * batch * n
            template = None
            for t in range(count):
                first = row + t * per
                second = up + t * per if up is not None else first if narrow else first + (br if tall else br // 2)
                if template is None or t == count - 1:     # encoded and checked: the first and the last tile
                    fields = dict(pool=pool, row=first, row2=second, rows=min(per, n - t * per),
                                  k=min(width, k - col), x=x.offset + col // (2 if xbf else 1),
                                  out=at_out + t * per // (2 if obf else 1),
                                  norm=-1 if norm is None else norm.offset,
                                  bias=-1 if bias is None else bias.offset + t * per, epi=EPILOGUES[epi], eps=eps,
                                  narrow=int(narrow), amax=-1 if amax is None else amax.offset + 2 * t,
                                  batch=batch, ostride=n, astride=2 * tiles_n,
                                  samp=-1 if samp is None else samp.offset, xbf=int(xbf), obf=int(obf), col=col, xk=k,
                                  tall=int(tall))
                    tiles.append(self.add(GEMV, after=after, worker=worker, **fields))
                    template = template or (fields, self.nodes[-1].body)
                else:
                    # a middle tile differs from the first only in fields between the first's and the
                    # last's (which fit int32): the first's fields and words with those set
                    tile = dict(row=first, row2=second, out=at_out + t * per // (2 if obf else 1),
                                bias=-1 if bias is None else bias.offset + t * per,
                                amax=-1 if amax is None else amax.offset + 2 * t)
                    body = list(template[1])
                    for name, at in _TILE_WORDS:
                        body[at] = tile[name]
                    self.nodes.append(Node(len(self.nodes), GEMV, {**template[0], **tile}, after.ids, worker,
                                           tuple(body)))
                    tiles.append(len(self.nodes) - 1)
        return tiles

    def attention(self, qkv: Region, out: Region, step: Region, cos: Region, sin: Region, *, heads: int,
                  kv_heads: int, layer: int, scale: float, qn: Region | None = None, kn: Region | None = None,
                  eps: float = 0.0, ctx: int = 1024, splits: int = 1, part: Region | None = None,
                  after=(), obf: bool = False) -> list[int]:
        """One ATTN node per KV head (kinds.ATTN): qkv holds [heads + 2 kv_heads] rows of head_dim;
        step holds pos, n_ctx, slot and the block table; cos/sin are [positions, head_dim / 2].
        With splits > 1, `splits` ATTN nodes per KV head over shares of the context write their
        partials to `part`, and the share that finishes last merges them into out (its ticket);
        returns the nodes whose completion means out is written. obf (a batched kernel): out gets
        bf16 rows (heads * head_dim / 2 floats), what a GEMV with xbf reads."""
        cfg, kv = self.config, self.kv
        if kv is None:
            raise ValueError("attention needs the KV cache: call kv_cache() first")
        layers, _, blocks, bs, kvh, hd = kv.shape
        if cfg.head_dim != hd:
            raise ValueError(f"the KV cache's head_dim is {hd}: build the program with StreamConfig(head_dim={hd})")
        if kvh != kv_heads or heads % kv_heads:
            raise ValueError(f"heads {heads} and kv_heads {kv_heads} do not match the cache's {kvh} KV heads")
        group = heads // kv_heads
        if group > cfg.attn_group:
            raise ValueError(f"a group of {group} q heads exceeds StreamConfig.attn_group {cfg.attn_group}")
        if not 0 <= layer < layers:
            raise ValueError(f"layer {layer} is outside the cache's {layers} layers")
        if obf and (not cfg.batch_rows or out.offset % 4):
            raise ValueError("obf (bf16 outputs) is for a batched kernel's attention, out 16-byte aligned")
        if qkv.size < (heads + 2 * kv_heads) * hd or out.size < heads * hd // (2 if obf else 1) or step.size < 4:
            raise ValueError(f"qkv needs {(heads + 2 * kv_heads) * hd} floats, out {heads * hd // (2 if obf else 1)}"
                             f"{' (bf16 rows)' if obf else ''}, step at least 4 words")
        if cos.size % (hd // 2) or cos.size != sin.size:
            raise ValueError(f"cos and sin are [positions, {hd // 2}] tables of one size")
        if splits < 1 or (splits > 1 and (part is None or part.size < kv_heads * splits * group * (hd + 2))):
            raise ValueError(f"splits {splits}: need at least 1, and for more a part region of "
                             f"{kv_heads * splits * group * (hd + 2)} floats")
        done, after = [], _Deps(self._deps(after))
        for g in range(kv_heads):
            here = -1 if part is None else part.offset + g * splits * group * (hd + 2)
            ticket = -1
            if splits > 1:
                ticket = len(self.tickets)
                self.tickets.append(splits)
            nodes = [self.add(ATTN, after=after, qkv=qkv.offset, out=out.offset, head=g * group, kvhead=g,
                              group=group, heads=heads, kvheads=kv_heads, hd=hd, step=step.offset, cos=cos.offset,
                              sin=sin.offset, qn=-1 if qn is None else qn.offset, kn=-1 if kn is None else kn.offset,
                              layer=layer, blocks=blocks, bs=bs, eps=eps, scale=scale, ctx=ctx, split=s,
                              splits=splits, part=here, ticket=ticket, obf=int(obf))
                     for s in range(splits)]
            done += nodes
        return done

    def cast(self, x: Region, out: Region, k: int, rows: int = 1, *, norm: Region | None = None, eps: float = 0.0,
             after=(), part: Region | None = None, parts: int = 0) -> list[int]:
        """Each of `rows` rows of k floats at x (row b at x + b * k), RMS-normalised with norm, as bf16
        into out (row b's k values from bf16 element 2 * out.offset + b * k): a node a row
        (kinds.CAST), for the GEMVs of a batched kernel (StreamConfig.batch_rows). part, parts: a
        split-K GEMV's partial sums (gemv's splits: split s's row b at part + (s * rows + b) * k), added
        into x's rows first, in split order."""
        if k % 8 or x.offset % 4 or out.offset % 4 or x.size < rows * k or out.size < rows * k // 2 or \
                (norm is not None and norm.size < k):
            raise ValueError(f"cast: k ({k}) a multiple of 8, x and out 16-byte aligned, x of {rows} x {k} floats, "
                             f"out of half that, norm of k")
        if not 0 <= parts <= MAX_CAST_PARTS or (parts and (part is None or part.size < parts * rows * k)) or \
                (part is not None and not parts):
            raise ValueError(f"cast: parts ({parts}; at most {MAX_CAST_PARTS}) partials of {rows} x {k} floats need a "
                             "part region that holds them, and a part region needs parts")
        deps = self._deps(after)
        return [self.add(CAST, after=deps, x=x.offset + b * k, out=out.offset + b * k // 2, k=k,
                         norm=-1 if norm is None else norm.offset, eps=eps,
                         part=-1 if part is None else part.offset + b * k, parts=parts, pstride=rows * k)
                for b in range(rows)]

    def embed(self, token: Region, out: Region, k: int, after=(), first: int | None = None) -> int:
        """out[:k] = the embedding row of the token at int-arena `token` (kinds.EMBED). first: the
        table is a vocabulary shard from token `first` (tensor parallelism), other tokens give zeros."""
        if self.emb is None:
            raise ValueError("embed needs the embedding table: call embedding() first")
        if k != self.emb.shape[1] or out.size < k or token.size < 1:
            raise ValueError(f"k must be the table's width {self.emb.shape[1]} and out hold it")
        return self.add(EMBED, after=after, token=token.offset, out=out.offset, k=k, rows=self.emb.shape[0],
                        first=first or 0, shard=int(first is not None))

    def sample(self, pairs: Region, count: int, logits: Region, token: Region, tokens: Region, after=(),
               per: int = 0, shard: int = 0) -> int:
        """The greedy token from `count` GEMV amax pairs into ints token and tokens[s] (kinds.SAMPLE).
        per and shard: the pairs are the tensor-parallel ranks' in turn, `per` a rank, each rank's
        logits `shard` tokens of the vocabulary."""
        if pairs.size < 2 * count or token.size < 1 or tokens.size < 1:
            raise ValueError("sample needs two floats a pair, a token word and a tokens list")
        if per and (count % per or shard < 1):
            raise ValueError(f"the ranks' pairs come {per} a rank ({count} pairs) over shards of {shard} tokens")
        if self.floats.size >= 2 ** 24:
            raise ValueError("an amax pair holds an arena offset as a float: the arena must stay under 2^24 floats")
        return self.add(SAMPLE, after=after, pairs=pairs.offset, count=count, base=logits.offset, token=token.offset,
                        tokens=tokens.offset, per=per, shard=shard)

    def allreduce(self, src: Region, out: Region, n: int, *, world: int, rank: int, epi: str = "store", after=(),
                  slice_floats: int = ALLREDUCE_SLICE) -> list[int]:
        """Tensor parallelism: out[:n] = (or +=, epi "add") the sum over the `world` ranks of each
        rank's src[:n] (kinds.ALLREDUCE), this program being rank `rank`'s, as slices of at most
        `slice_floats` floats, one node each (the ranks' CTAs then share the work); returns the nodes."""
        if world < 2 or not 0 <= rank < world:
            raise ValueError(f"an all-reduce needs at least two ranks and a rank among them, not rank {rank} "
                             f"of {world}")
        if n < 1 or src.size < n or out.size < n:
            raise ValueError(f"an all-reduce of {n} floats needs src and out to hold them")
        if epi not in ("store", "add"):
            raise ValueError(f"an all-reduce's epi is 'store' or 'add', not {epi!r}")
        deps = _Deps(self._deps(after))
        nodes = []
        for lo in range(0, n, slice_floats):
            self.meets.append(world)
            nodes.append(self.add(ALLREDUCE, after=deps, src=src.offset + lo, out=out.offset + lo,
                                  n=min(slice_floats, n - lo), epi=EPILOGUES[epi], world=world, rank=rank,
                                  meet=len(self.meets) - 1))
        return nodes

    def decode_loop(self, sample, embed) -> None:
        """Run after run, `embed` waits for the run before's `sample` (its token): a launch of
        several runs is a decode loop. A batch passes a list of each, row by row. Every other node
        must descend from every `embed` and be an ancestor of every `sample`, so a run's writes
        never overtake the run before's reads."""
        samples, embeds = ([sample], [embed]) if isinstance(sample, int) else (list(sample), list(embed))
        if len(samples) != len(embeds) or not samples:
            raise ValueError("a decode loop pairs each row's SAMPLE node with its EMBED node")
        for s, e in zip(samples, embeds, strict=True):
            if self.nodes[s].kind is not SAMPLE or self.nodes[e].kind is not EMBED or self.nodes[e].deps:
                raise ValueError("a decode loop runs from an EMBED node with no dependencies to a SAMPLE node")
        self.loop = list(zip(samples, embeds, strict=True))

    # -- compiling -------------------------------------------------------------------------------
    def build(self, ctas: int, check: bool = True, cache: str | os.PathLike | None = None) -> Built:
        """Place the nodes on `ctas` CTAs and encode every CTA's instruction list. check: run the
        hazard check first (a caller building variants of one recording checks one of them).
        cache: a folder of builds, so a server's next start skips placement: one file a program,
        named by a hash of everything build reads and of the code that builds and checks; a file
        that cannot be read is built again and replaced. A build read from it has only the arrays."""
        return build_program(self, ctas, check, cache)

    def int_arena(self, device="cpu"):
        """A fresh int arena: zeros, with every int buffer's init copied in."""
        return self.ints_space.tensor(device)

    def arena(self, device="cpu"):
        """A fresh arena: zeros, with every buffer's init copied in."""
        return self.floats.tensor(device)


# the GEMV fields a gemv()'s tiles differ in, with their index in the encoded body
_TILE_WORDS = tuple((name, GEMV.word(name) - len(HEADER)) for name in ("row", "row2", "out", "bias", "amax"))


class _Deps(NamedTuple):
    """Dependencies already normalised by StreamProgram._deps."""
    ids: tuple[int, ...]


def _flat(after):
    if isinstance(after, int):
        return [after]
    out = []
    for a in after or ():
        out.extend(_flat(a) if isinstance(a, (list, tuple)) else [a])
    return out
