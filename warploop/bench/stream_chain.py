"""A decode step's weight stream as a streaming program: every projection of a model's layers with
its fused norm, bias (qkv, o_proj) and epilogue, then lm_head. No attention, RoPE, embedding or sampling (o_proj reads
the q part of qkv where attention's output would be). Random weights of the model's exact shapes.

    chain = layer_chain(LLAMA_3_2_1B, StreamConfig(), device="cuda")
    chain.program, chain.weight_bytes, chain.peer()     # the same math in PyTorch (bf16, a CUDA graph)
"""
from __future__ import annotations

import dataclasses

from warploop.runtime.stream.arena import Region
from warploop.runtime.stream.compiled import StreamConfig
from warploop.runtime.stream.program import StreamProgram


@dataclasses.dataclass
class Chain:
    program: StreamProgram
    mats: dict                      # name -> [rows, K] view of its pool (gate_up: [gate; up])
    regions: dict                   # res, qkv, act, logits, norms
    dims: dict
    weight_bytes: int
    stages: list                    # (matrix name, its tiles' node indices), in recording order

    def view(self, arena, name: str):
        r = self.regions[name]
        return arena[r.offset:r.offset + r.size]

    def peer(self):
        """One step in PyTorch as a function of the residual, bf16 activations (what cuBLAS GEMV
        takes): the same weight bytes, one kernel per op (run it in a CUDA graph)."""
        import torch
        from torch.nn.functional import rms_norm, silu
        d = self.dims
        arena = self.program.arena(self.mats["head"].device)
        norms = [self.view(arena, f"n{i}").to(torch.bfloat16) for i in range(2 * d["layers"] + 1)]
        bias = {k: self.view(arena, k).to(torch.bfloat16) for k in self.regions if k.startswith("b")}
        zero = torch.zeros((), dtype=torch.bfloat16, device=arena.device)
        shape, eps = (d["hidden"],), d["eps"]

        def step(res):
            for i in range(d["layers"]):
                qkv = torch.mv(self.mats[f"qkv{i}"], rms_norm(res, shape, norms[2 * i], eps))
                qkv = qkv + bias.get(f"bqkv{i}", zero)
                res = res + torch.mv(self.mats[f"o{i}"], qkv[:d["q"]]) + bias.get(f"bo{i}", zero)
                gate, up = torch.mv(self.mats[f"gu{i}"], rms_norm(res, shape, norms[2 * i + 1], eps)).chunk(2)
                res = res + torch.mv(self.mats[f"down{i}"], silu(gate) * up)
            return torch.mv(self.mats["head"], rms_norm(res, shape, norms[-1], eps))
        return step


def layer_chain(model, cfg: StreamConfig, device="cpu", layers: int | None = None, seed: int = 0,
                context: int = 0, block_size: int = 16, splits: int = 1, narrow: bool = True) -> Chain:
    """The chain of `model` (a ModelConfig). With `context` > 0 each layer has attention too (one
    ATTN node per KV head, cfg.head_dim set): a decode token at position context - 1 over a random
    paged bf16 KV cache of `context` tokens whose block table is shuffled, each KV head's context in
    `splits` shares, the last to finish merging them. narrow: the stages
    llm.stream_record.narrow picks run as narrow tiles (else every tile is BR rows)."""
    import torch

    from warploop.llm.stream_record import narrow as narrow_for
    thin = lambda rows: narrow and narrow_for(rows, cfg)
    hidden, q, kv, inter = model.hidden_size, model.num_heads * model.head_dim, \
        model.num_kv_heads * model.head_dim, model.intermediate_size
    layers = layers or model.num_layers
    # (name, rows, width) in recording order; one pool per width, matrices packed in this order
    shapes = []
    for i in range(layers):
        shapes += [(f"qkv{i}", q + 2 * kv, hidden), (f"o{i}", hidden, q), (f"gu{i}", 2 * inter, hidden),
                   (f"down{i}", hidden, inter)]
    shapes.append(("head", model.vocab_size, hidden))
    widths = sorted({k for _, _, k in shapes})
    total = {k: sum(n for _, n, kk in shapes if kk == k) for k in widths}
    p = StreamProgram(cfg)
    g = torch.Generator(device=device).manual_seed(seed)
    pools = {}
    for k in widths:
        w = torch.empty(total[k], k, dtype=torch.bfloat16, device=device)
        for part in w.split(8192):                    # N(0, 1/K) keeps activations of order 1
            part.normal_(0.0, k ** -0.5, generator=g)
        pools[k] = (p.pool(w), w)
    mats, at, used = {}, {}, dict.fromkeys(widths, 0)
    for name, n, k in shapes:
        at[name] = (pools[k][0], used[k])
        mats[name] = pools[k][1][used[k]:used[k] + n]
        used[k] += n
    r = {"res": p.buffer("res", hidden, init=torch.randn(hidden, generator=g, device=device)),
         "qkv": p.buffer("qkv", q + 2 * kv), "act": p.buffer("act", inter),
         "logits": p.buffer("logits", model.vocab_size)}
    qkv_bias, o_bias = getattr(model, "qkv_bias", False), getattr(model, "o_bias", False)
    for i in range(layers):
        if qkv_bias:
            r[f"bqkv{i}"] = p.buffer(f"bqkv{i}", q + 2 * kv,
                                     init=0.1 * torch.randn(q + 2 * kv, generator=g, device=device))
        if o_bias:
            r[f"bo{i}"] = p.buffer(f"bo{i}", hidden, init=0.1 * torch.randn(hidden, generator=g, device=device))
    for i in range(2 * layers + 1):
        r[f"n{i}"] = p.buffer(f"n{i}", hidden, init=1 + 0.1 * torch.randn(hidden, generator=g, device=device))
    eps = model.rms_norm_eps
    kv_bytes = 0
    if context:
        hd, kvh = model.head_dim, model.num_kv_heads
        nblocks = -(-context // block_size) + 1
        cache = torch.randn(layers, 2, nblocks, block_size, kvh, hd, generator=g, device=device).to(torch.bfloat16)
        p.kv_cache(cache)
        table = torch.randperm(nblocks, generator=torch.Generator().manual_seed(seed))[:-(-context // block_size)]
        pos = context - 1
        slot = int(table[pos // block_size]) * block_size + pos % block_size
        r["step"] = p.ints("step", 3 + len(table), init=torch.cat([torch.tensor([pos, context, slot]), table]))
        from warploop.llm.rope import cos_sin_table
        cos, sin = cos_sin_table(model.rope, hd, context, device=device)
        r["cos"], r["sin"] = p.buffer("cos", cos.numel(), init=cos), p.buffer("sin", sin.numel(), init=sin)
        r["attn"] = p.buffer("attn", q)
        group = model.num_heads // kvh
        r["part"] = p.buffer("part", kvh * splits * group * (hd + 2)) if splits > 1 else None
        if getattr(model, "qk_norm", False):
            for i in range(layers):
                r[f"qn{i}"] = p.buffer(f"qn{i}", hd, init=1 + 0.1 * torch.randn(hd, generator=g, device=device))
                r[f"kn{i}"] = p.buffer(f"kn{i}", hd, init=1 + 0.1 * torch.randn(hd, generator=g, device=device))
        kv_bytes = layers * 2 * context * kvh * hd * 2
    prev: list[int] = []
    stages = []
    for i in range(layers):
        a = p.gemv(*at[f"qkv{i}"], q + 2 * kv, r["res"], r["qkv"], norm=r[f"n{2 * i}"], eps=eps,
                   narrow=thin(q + 2 * kv),
                   bias=r.get(f"bqkv{i}"), after=prev)
        stages.append((f"qkv{i}", a))
        x_o = Region(r["qkv"].offset, q)
        if context:
            at_n = p.attention(r["qkv"], r["attn"], r["step"], r["cos"], r["sin"], heads=model.num_heads,
                               kv_heads=model.num_kv_heads, layer=i, scale=model.head_dim ** -0.5,
                               qn=r.get(f"qn{i}"), kn=r.get(f"kn{i}"), eps=eps, ctx=context, splits=splits,
                               part=r["part"], after=a)
            stages.append((f"attn{i}", at_n))
            a, x_o = at_n, r["attn"]
        b = p.gemv(*at[f"o{i}"], hidden, x_o, r["res"], epi="add", bias=r.get(f"bo{i}"), after=a, narrow=thin(hidden))
        c = p.gemv(*at[f"gu{i}"], inter, r["res"], r["act"], norm=r[f"n{2 * i + 1}"], eps=eps, epi="silu_mul",
                   up=at[f"gu{i}"][1] + inter, after=b)
        prev = p.gemv(*at[f"down{i}"], hidden, r["act"], r["res"], epi="add", after=c, narrow=thin(hidden))
        stages += [(f"o{i}", b), (f"gu{i}", c), (f"down{i}", prev)]
    stages.append(("head", p.gemv(*at["head"], model.vocab_size, r["res"], r["logits"], norm=r[f"n{2 * layers}"],
                                  eps=eps, after=prev)))
    wbytes = sum(n * k * 2 for _, n, k in shapes)
    dims = dict(hidden=hidden, q=q, kv=kv, inter=inter, layers=layers, eps=eps, context=context)
    return Chain(p, mats, r, dims, wbytes + kv_bytes, stages)


def stage_chain(cfg: StreamConfig, stages: int, cross: bool, device="cpu", seed: int = 0) -> StreamProgram:
    """`stages` dependent one-tile GEMVs of one [BR, BK] chunk each (x -> y -> x ...): the cost of a
    dependent stage. cross: the stages alternate between CTAs 0 and 1 (each wait crosses SMs); else
    all run on CTA 0 (the waits are met locally and skipped)."""
    import torch
    k = cfg.block_k
    g = torch.Generator(device=device).manual_seed(seed)
    p = StreamProgram(cfg)
    w = torch.empty(stages * cfg.block_rows, k, dtype=torch.bfloat16, device=device).normal_(0, k ** -0.5,
                                                                                               generator=g)
    pool = p.pool(w)
    bufs = [p.buffer("a", k, init=torch.randn(k, generator=g, device=device)), p.buffer("b", k)]
    prev: list[int] = []
    for s in range(stages):
        src, dst = bufs[s % 2], bufs[(s + 1) % 2]
        # each stage rewrites dst's first BR floats; the rest stays as it was (zeros or the input)
        prev = p.gemv(pool, s * cfg.block_rows, cfg.block_rows, src, dst, after=prev,
                      worker=(s % 2) if cross else 0)
    return p
