"""The per-op GPU path's Triton kernels, compiled ahead of time into the bundle the package ships
(warploop/llm/shipped/ops.wlb, rebuilt by scripts/ops_bundle.py), so a server starts with no compiler.

Their wrappers are in triton_ops.py (rms_norm, qk_rope_cache, silu_mul) and paged_attention.py
(decode split + merge, prefill); ops_prebuilt.py launches them from the bundle, or through Triton's
JIT where the bundle has no fitting specialization. Model shapes (rows, hidden and intermediate
sizes, head counts, page size) are runtime arguments; only the head dim, tile sizes and flags are
constexprs, so one compiled set serves every model with a head dim of 64 or 128.

This file stands alone: it imports Triton and warploop (for `export`) and nothing beside it, since a
bundle's cpu variant carries this file's text only. Each export promises what Triton's JIT assumes
when it holds (aligned tensors, row sizes divisible by 16), so the bundle's code is the code the JIT
would make (vectorised loads); a launch that breaks a promise goes to the JIT. The wrappers' tile
constants must match the constexprs exported here (tests/test_ops_prebuilt.py checks it).
"""
import triton
import triton.language as tl

import warploop

DTYPES = ("bf16", "fp16", "fp32")
# prefill_kernel's float32 dots ("ieee": no tensor cores) unroll into 1.6 MB of code a target, and only
# float32 models, rare on a GPU, need it: float32 JITs it
HALF_DTYPES = ("bf16", "fp16")
FLOAT_POINTERS = ("*bf16", "*fp16", "*fp32")
HEAD_DIMS = (64, 128)
ROW_BLOCKS = (1024, 2048, 4096, 8192)   # rms_norm: rows up to 8192 wide in registers, wider ones in a loop


def exports(variants, divisible=()):
    """Stack one `warploop.export` per (signature, constexprs[, num_warps]) of `variants`, the first
    being the default, each promising 16-byte aligned float pointers (activations, weights, caches:
    vectorised loads) and the integers in `divisible` divisible by 16. Index pointers (positions,
    slots, tables) get no promise: they are read one value at a time, and callers pass slices of
    one int32 buffer (cuda_graphs.py, PrefillPlan) at any 4-byte offset."""
    variants = list(variants)

    def decorate(kernel):
        for signature, constexprs, *warps in reversed(variants):
            promise = {n: 16 for n, t in signature.items() if t in FLOAT_POINTERS or n in divisible}
            kernel = warploop.export(signature=signature, constexprs=constexprs, specialize=promise,
                                     num_warps=warps[0] if warps else 4)(kernel)
        return kernel
    return decorate


def row_warps(block):
    """Warps for a row of `block` columns, as Triton's layer-norm tutorial picks them: 4 up to 1024
    columns, 8 from 2048 on (its threads then hold 8 to 32 values each)."""
    return min(max(block // 256, 1), 8)


@triton.jit
def rms_norm_row(x_row, res_row, w_ptr, out_row, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """One row of at most BLOCK columns, held in registers: read once, written once."""
    dt = x_row.dtype.element_ty
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_row + cols, mask=mask, other=0.0)
    if HAS_RES:
        # transformers adds the residual in the model's dtype, then normalises the rounded sum
        r = tl.load(res_row + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_row + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_row + cols, w * (xf * rstd).to(dt).to(tl.float32), mask=mask)


@exports([({"x_ptr": f"*{dt}", "res_ptr": f"*{dt}", "w_ptr": f"*{dt}", "out_ptr": f"*{dt}", "n_cols": "i32",
            "eps": "fp32"}, {"HAS_RES": has_res, "BLOCK": block}, row_warps(block))
          for dt in DTYPES for has_res in (False, True) for block in ROW_BLOCKS], divisible=("n_cols",))
@triton.jit
def rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (row,): out = norm(x + res) * w, and res = x + res when HAS_RES. Rows of up to BLOCK
    columns are read once; only the widest BLOCK also takes wider rows, a block at a time."""
    row = tl.program_id(0).to(tl.int64)
    x_row, res_row, out_row = x_ptr + row * n_cols, res_ptr + row * n_cols, out_ptr + row * n_cols
    if BLOCK < 8192:   # decided at compile time: the wrapper gives narrower BLOCKs only rows that fit
        rms_norm_row(x_row, res_row, w_ptr, out_row, n_cols, eps, HAS_RES, BLOCK)
    elif n_cols <= BLOCK:
        rms_norm_row(x_row, res_row, w_ptr, out_row, n_cols, eps, HAS_RES, BLOCK)
    else:
        # the sum of squares over column blocks, then the output. The second pass adds the residual
        # again rather than read back the first pass's stores, which other threads made.
        dt = x_ptr.dtype.element_ty
        squares = tl.zeros([BLOCK], tl.float32)
        c0 = 0
        while c0 < n_cols:  # while loops: the Triton interpreter cannot run range() over runtime bounds
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
            xf = x.to(tl.float32)
            squares += xf * xf
            c0 += BLOCK
        rstd = tl.rsqrt(tl.sum(squares, axis=0) / n_cols + eps)
        c0 = 0
        while c0 < n_cols:
            cols = c0 + tl.arange(0, BLOCK)
            mask = cols < n_cols
            x = tl.load(x_row + cols, mask=mask, other=0.0)
            if HAS_RES:
                x = (x.to(tl.float32) + tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)).to(dt)
                tl.store(res_row + cols, x, mask=mask)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + cols, w * (x.to(tl.float32) * rstd).to(dt).to(tl.float32), mask=mask)
            c0 += BLOCK


@exports([({"gu_ptr": f"*{dt}", "out_ptr": f"*{dt}", "n_cols": "i32"}, {"BLOCK": 1024}) for dt in DTYPES],
         divisible=("n_cols",))
@triton.jit
def silu_mul_kernel(gu_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(gu_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    # transformers rounds silu(g) to the model dtype before the product
    act = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, act * u, mask=mask)


@exports([({"qkv_ptr": f"*{dt}", "pos_ptr": "*i32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slot_ptr": "*i32",
            "k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}", "qn_ptr": f"*{dt}", "kn_ptr": f"*{dt}", "eps": "fp32",
            "num_heads": "i32", "num_kv_heads": "i32"}, {"HEAD_DIM": d, "HAS_QK_NORM": norm})
          for dt in DTYPES for d in HEAD_DIMS for norm in (False, True)])
@triton.jit
def qk_rope_cache_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, k_cache_ptr, v_cache_ptr, qn_ptr, kn_ptr, eps,
                         num_heads, num_kv_heads, HEAD_DIM: tl.constexpr, HAS_QK_NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)          # q heads, then k heads (they are adjacent in qkv)
    HALF: tl.constexpr = HEAD_DIM // 2
    row_len = (num_heads + 2 * num_kv_heads) * HEAD_DIM
    d = tl.arange(0, HALF)
    base = qkv_ptr + tok * row_len + head * HEAD_DIM
    x1 = tl.load(base + d).to(tl.float32)
    x2 = tl.load(base + HALF + d).to(tl.float32)
    if HAS_QK_NORM:
        is_q = head < num_heads
        w1 = tl.where(is_q, tl.load(qn_ptr + d), tl.load(kn_ptr + d)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + d), tl.load(kn_ptr + HALF + d)).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        dt = qkv_ptr.dtype.element_ty
        x1 = (w1 * (x1 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    c = tl.load(cos_ptr + pos * HALF + d)
    s = tl.load(sin_ptr + pos * HALF + d)
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    tl.store(base + d, o1)
    tl.store(base + HALF + d, o2)
    if head >= num_heads:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kv_head = head - num_heads
            dst = (slot * num_kv_heads + kv_head) * HEAD_DIM
            tl.store(k_cache_ptr + dst + d, o1)
            tl.store(k_cache_ptr + dst + HALF + d, o2)
            full = tl.arange(0, HEAD_DIM)
            v = tl.load(qkv_ptr + tok * row_len + (num_heads + num_kv_heads + kv_head) * HEAD_DIM + full)
            tl.store(v_cache_ptr + dst + full, v)


# Paged attention. The KV cache of one layer is [num_blocks, block_size, num_kv_heads, HEAD_DIM];
# block tables map each sequence's token t to block tables[seq, t // block_size]. Dots use
# input_precision "ieee": float32 models stay exact (no tf32); bf16/fp16 operands use tensor cores anyway.

@triton.jit
def attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d, toks, valid, see,
                scale, num_kv_heads, block_size, HEAD_DIM: tl.constexpr):
    """One step of online softmax: the keys and values of context tokens `toks` (`valid` ones read
    through the block table), the scores q k^T where `see` ([rows, tokens]) lets a row see a token,
    folded into the running max m, sum l and output acc. Returns (m, l, acc)."""
    block = tl.load(tables_ptr + seq * table_stride + toks // block_size, mask=valid, other=0).to(tl.int64)
    slot = block * block_size + toks % block_size
    offs = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    s = tl.where(see, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m - m_new)
    v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, acc


def _paged(dt):
    return {"k_cache_ptr": f"*{dt}", "v_cache_ptr": f"*{dt}", "tables_ptr": "*i32", "table_stride": "i32"}


@exports([({"q_ptr": f"*{dt}", "q_row_stride": "i32", **_paged(dt), "ctx_ptr": "*i32", "part_out_ptr": "*fp32",
            "part_lse_ptr": "*fp32", "scale": "fp32", "max_splits": "i32", "num_kv_heads": "i32", "group": "i32",
            "block_size": "i32"}, {"GROUP_PAD": 16, "HEAD_DIM": d, "TILE": 64, "PARTITION": 512})
          for dt in DTYPES for d in HEAD_DIMS], divisible=("q_row_stride",))
@triton.jit
def decode_split_kernel(q_ptr, q_row_stride, k_cache_ptr, v_cache_ptr, tables_ptr, table_stride, ctx_ptr,
                        part_out_ptr, part_lse_ptr, scale, max_splits, num_kv_heads, group, block_size,
                        GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
                        PARTITION: tl.constexpr):
    """Grid (sequence, kv head x group chunk, split): GROUP_PAD query heads sharing one KV head (a GQA
    group, or a chunk of a larger one; rows padded for tl.dot) over one PARTITION of the context."""
    seq = tl.program_id(0).to(tl.int64)
    chunks = (group + GROUP_PAD - 1) // GROUP_PAD
    kv_head = tl.program_id(1) // chunks
    first = tl.program_id(1) % chunks * GROUP_PAD
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * PARTITION
    if start < ctx:
        g = first + tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * group + g
        q = tl.load(q_ptr + seq * q_row_stride + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=(g < group)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        end = tl.minimum(start + PARTITION, ctx)
        t0 = start
        while t0 < end:  # a while loop: the Triton interpreter cannot run range() over tensor bounds
            toks = t0 + tl.arange(0, TILE)
            valid = toks < end
            m, l, acc = attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head,
                                    d, toks, valid, valid[None, :], scale, num_kv_heads, block_size, HEAD_DIM)
            t0 += TILE
        row = (seq * num_kv_heads * group + heads) * max_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l[:, None], mask=(g < group)[:, None])
        tl.store(part_lse_ptr + row, m + tl.log(l), mask=g < group)


@exports([({"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "ctx_ptr": "*i32", "out_ptr": f"*{dt}",
            "max_splits": "i32", "num_heads": "i32"}, {"HEAD_DIM": d, "PARTITION": 512, "SPLITS": 16})
          for dt in DTYPES for d in HEAD_DIMS])
@triton.jit
def decode_merge_kernel(part_out_ptr, part_lse_ptr, ctx_ptr, out_ptr, max_splits, num_heads, HEAD_DIM: tl.constexpr,
                        PARTITION: tl.constexpr, SPLITS: tl.constexpr):
    """Grid (sequence, head): the splits' outputs weighted by their log-sum-exp, SPLITS at a time."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    if ctx > 0:
        n = (ctx + PARTITION - 1) // PARTITION
        base = (seq * num_heads + head) * max_splits
        sp = tl.arange(0, SPLITS)
        top = tl.full([SPLITS], float("-inf"), tl.float32)
        s0 = 0
        while s0 < n:
            top = tl.maximum(top, tl.load(part_lse_ptr + base + s0 + sp, mask=s0 + sp < n, other=float("-inf")))
            s0 += SPLITS
        top_lse = tl.max(top, axis=0)
        acc = tl.zeros([SPLITS, HEAD_DIM], tl.float32)
        total = tl.zeros([SPLITS], tl.float32)
        s0 = 0
        while s0 < n:
            s = s0 + sp
            weight = tl.exp(tl.load(part_lse_ptr + base + s, mask=s < n, other=float("-inf")) - top_lse)
            parts = tl.load(part_out_ptr + (base + s)[:, None] * HEAD_DIM + d[None, :], mask=(s < n)[:, None],
                            other=0.0)
            acc += parts * weight[:, None]
            total += weight
            s0 += SPLITS
        tl.store(out_ptr + (seq * num_heads + head) * HEAD_DIM + d, tl.sum(acc, axis=0) / tl.sum(total, axis=0))


@triton.jit
def prefill_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d, toks, pos, end,
                 qk_scale, num_kv_heads, block_size, HEAD_DIM: tl.constexpr, MASKED: tl.constexpr):
    """One step of prefill's online softmax in base 2 (qk_scale holds log2(e)): context tokens `toks`
    read through the block table. MASKED: the tile crosses the causal diagonal or the context's
    end (masks on the loads and the scores); otherwise every row sees every token, unmasked."""
    if MASKED:
        valid = toks < end
        block = tl.load(tables_ptr + seq * table_stride + toks // block_size, mask=valid, other=0).to(tl.int64)
    else:
        block = tl.load(tables_ptr + seq * table_stride + toks // block_size).to(tl.int64)
    slot = block * block_size + toks % block_size
    offs = (slot[:, None] * num_kv_heads + kv_head) * HEAD_DIM + d[None, :]
    if MASKED:
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_cache_ptr + offs)
        v = tl.load(v_cache_ptr + offs)
    s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale
    if MASKED:
        s = tl.where(valid[None, :] & (toks[None, :] <= pos[:, None]), s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    l = l * alpha + tl.sum(p, axis=1)
    return m_new, l, acc


# prefill's tiles (H200, per layer, Llama-3.2-1B and Qwen3-0.6B heads, 2,048 new tokens over 16,384):
# the software-pipelined loops (tl.range, 3 stages) with 128 query rows and 8 warps took 0.90 and
# 1.05 ms against the unpipelined while loop's 1.37 and 1.70 ms. Triton's interpreter runs a for loop
# over runtime bounds from Triton 3.7 on (3.6's cannot: its tests then skip this kernel)
@exports([({"q_ptr": f"*{dt}", "q_row_stride": "i32", **_paged(dt), "blk_seq_ptr": "*i32", "blk_row_ptr": "*i32",
            "q_start_ptr": "*i32", "q_len_ptr": "*i32", "ctx_ptr": "*i32", "out_ptr": f"*{dt}", "scale": "fp32",
            "num_heads": "i32", "num_kv_heads": "i32", "group": "i32", "block_size": "i32"},
           {"HEAD_DIM": d, "BM": 128, "BN": 64}, 8)
          for dt in HALF_DTYPES for d in HEAD_DIMS], divisible=("q_row_stride",))
@triton.jit
def prefill_kernel(q_ptr, q_row_stride, k_cache_ptr, v_cache_ptr, tables_ptr, table_stride, blk_seq_ptr,
                   blk_row_ptr, q_start_ptr, q_len_ptr, ctx_ptr, out_ptr, scale, num_heads, num_kv_heads, group,
                   block_size, HEAD_DIM: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """Grid (query block, head): BM new tokens of one sequence over its context, causally: first the
    tiles every row sees whole (pipelined, unmasked), then those that cross the diagonal."""
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(blk_seq_ptr + pid).to(tl.int64)
    r0 = tl.load(blk_row_ptr + pid)
    q0 = tl.load(q_start_ptr + seq)
    qlen = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    kv_head = head // group
    i = r0 + tl.arange(0, BM)
    rows = i < qlen
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q0 + i)[:, None].to(tl.int64) * q_row_stride + head * HEAD_DIM + d[None, :],
                mask=rows[:, None], other=0.0)
    p0 = ctx - qlen + r0                   # the block's first query's position; each row sees up to its own
    pos = p0 + tl.arange(0, BM)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 in the softmax
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM], tl.float32)
    end = tl.minimum(ctx, p0 + BM)         # past the block's last query's position
    whole = (p0 + 1) // BN                 # tiles below every row's position
    for j in tl.range(0, whole, num_stages=3):
        m, l, acc = prefill_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d,
                                 j * BN + tl.arange(0, BN), pos, end, qk_scale, num_kv_heads, block_size, HEAD_DIM,
                                 False)
    # causal: each row's first tile holds token 0 or a whole tile before it, so m is finite from there on
    for j in tl.range(whole, tl.cdiv(end, BN)):
        m, l, acc = prefill_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d,
                                 j * BN + tl.arange(0, BN), pos, end, qk_scale, num_kv_heads, block_size, HEAD_DIM,
                                 True)
    out = acc / l[:, None]
    tl.store(out_ptr + (q0 + i)[:, None].to(tl.int64) * (num_heads * HEAD_DIM) + head * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None])
