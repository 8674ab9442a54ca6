"""Decode attention straight from the paged KV cache, in Triton (flash-decoding with split-K).

Grid (sequence, kv head, split): each program takes the query heads that share one KV head (GQA
group, padded to 16 rows for tl.dot) over one PARTITION of the context, walking it in TILE-token
steps through the block table, so any block size works. A second kernel merges the splits by their
log-sum-exp. Both grids are fixed by the batch size and the longest context, so the pair can be
captured in a CUDA graph and replayed for any mix of context lengths. Dots use input_precision
"ieee": float32 models stay exact (no tf32), and bf16/fp16 operands use the tensor cores anyway.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 64
PARTITION = 512


@triton.jit
def _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d, toks, valid, see,
                 scale, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One step of online softmax: the keys and values of context tokens `toks` (`valid` ones read
    through the block table), the scores q k^T where `see` ([rows, tokens]) lets a row see a token,
    folded into the running max m, sum l and output acc. Returns (m, l, acc)."""
    block = tl.load(tables_ptr + seq * table_stride + toks // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    slot = block * BLOCK_SIZE + toks % BLOCK_SIZE
    offs = (slot[:, None] * NUM_KV_HEADS + kv_head) * HEAD_DIM + d[None, :]
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


@triton.jit
def _decode_split_kernel(q_ptr, q_row_stride, k_cache_ptr, v_cache_ptr, tables_ptr, table_stride, ctx_ptr,
                         part_out_ptr, part_lse_ptr, scale, max_splits,
                         NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
                         PARTITION: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + seq)
    start = split * PARTITION
    if start < ctx:
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * q_row_stride + heads[:, None] * HEAD_DIM + d[None, :],
                    mask=(g < GROUP)[:, None], other=0.0)
        m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        end = tl.minimum(start + PARTITION, ctx)
        t0 = start
        while t0 < end:  # a while loop: the Triton interpreter cannot run range() over tensor bounds
            toks = t0 + tl.arange(0, TILE)
            valid = toks < end
            m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head,
                                     d, toks, valid, valid[None, :], scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
            t0 += TILE
        row = (seq * NUM_KV_HEADS * GROUP + heads) * max_splits + split
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], acc / l[:, None], mask=(g < GROUP)[:, None])
        tl.store(part_lse_ptr + row, m + tl.log(l), mask=g < GROUP)


@triton.jit
def _decode_merge_kernel(part_out_ptr, part_lse_ptr, ctx_ptr, out_ptr, max_splits, NUM_HEADS: tl.constexpr,
                         HEAD_DIM: tl.constexpr, PARTITION: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    ctx = tl.load(ctx_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    if ctx > 0:
        n = (ctx + PARTITION - 1) // PARTITION
        sp = tl.arange(0, SPLITS_PAD)
        row = (seq * NUM_HEADS + head) * max_splits + sp
        lse = tl.load(part_lse_ptr + row, mask=sp < n, other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, axis=0))
        parts = tl.load(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=(sp < n)[:, None], other=0.0)
        out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + (seq * NUM_HEADS + head) * HEAD_DIM + d, out)


class DecodeWorkspace:
    """Scratch for the split results, sized once for the batch and the longest context."""

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_context: int, device) -> None:
        self.max_splits = triton.cdiv(max_context, PARTITION)
        self.out = torch.empty((max_batch, num_heads, self.max_splits, head_dim), dtype=torch.float32, device=device)
        self.lse = torch.empty((max_batch, num_heads, self.max_splits), dtype=torch.float32, device=device)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, workspace: DecodeWorkspace) -> torch.Tensor:
    """q [B, H, D] (rows may be strided) over the paged context -> [B, H * D] in q's dtype.

    k_cache/v_cache: one layer, [num_blocks, block_size, KV, D]; block_tables [B, W] int32;
    context_lens [B] int32 (0 for padding rows, whose output is left unwritten)."""
    b, h, d = q.shape
    _, block_size, kv_heads, dk = k_cache.shape
    assert dk == d and h % kv_heads == 0 and q.stride(2) == 1 and q.stride(1) == d
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32 and block_tables.stride(1) == 1
    assert b <= workspace.out.shape[0] and block_tables.shape[1] * block_size <= workspace.max_splits * PARTITION
    group = h // kv_heads
    out = torch.empty((b, h * d), dtype=q.dtype, device=q.device)
    _decode_split_kernel[(b, kv_heads, workspace.max_splits)](
        q, q.stride(0), k_cache, v_cache, block_tables, block_tables.stride(0), context_lens,
        workspace.out, workspace.lse, scale, workspace.max_splits,
        NUM_KV_HEADS=kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
        BLOCK_SIZE=block_size, TILE=TILE, PARTITION=PARTITION)
    _decode_merge_kernel[(b, h)](workspace.out, workspace.lse, context_lens, out, workspace.max_splits,
                                 NUM_HEADS=h, HEAD_DIM=d, PARTITION=PARTITION,
                                 SPLITS_PAD=max(2, triton.next_power_of_2(workspace.max_splits)))
    return out


PREFILL_BM = 64          # new tokens a program takes (its query rows)
PREFILL_BN = 64          # context tokens a step


@triton.jit
def _prefill_kernel(q_ptr, q_row_stride, k_cache_ptr, v_cache_ptr, tables_ptr, table_stride, blk_seq_ptr,
                    blk_row_ptr, q_start_ptr, q_len_ptr, ctx_ptr, out_ptr, scale, NUM_HEADS: tl.constexpr,
                    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(blk_seq_ptr + pid).to(tl.int64)
    r0 = tl.load(blk_row_ptr + pid)
    q0 = tl.load(q_start_ptr + seq)
    qlen = tl.load(q_len_ptr + seq)
    ctx = tl.load(ctx_ptr + seq)
    kv_head = head // GROUP
    i = r0 + tl.arange(0, BM)
    rows = i < qlen
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (q0 + i)[:, None].to(tl.int64) * q_row_stride + head * HEAD_DIM + d[None, :],
                mask=rows[:, None], other=0.0)
    pos = ctx - qlen + i                   # each query's position: it sees the context up to it
    m = tl.full([BM], float("-inf"), tl.float32)
    l = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, HEAD_DIM], tl.float32)
    end = tl.minimum(ctx, ctx - qlen + r0 + BM)  # past the block's last query's position
    t0 = 0
    while t0 < end:  # a while loop: the Triton interpreter cannot run range() over tensor bounds
        toks = t0 + tl.arange(0, BN)
        valid = toks < end
        # causal: every row sees token 0 in the first step, so m is finite from there on
        m, l, acc = _attend_tile(q, m, l, acc, k_cache_ptr, v_cache_ptr, tables_ptr, seq, table_stride, kv_head, d,
                                 toks, valid, valid[None, :] & (toks[None, :] <= pos[:, None]), scale, NUM_KV_HEADS,
                                 HEAD_DIM, BLOCK_SIZE)
        t0 += BN
    out = acc / l[:, None]
    tl.store(out_ptr + (q0 + i)[:, None].to(tl.int64) * (NUM_HEADS * HEAD_DIM) + head * HEAD_DIM + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rows[:, None])


class PrefillPlan:
    """A prefill batch's sequences as the kernel reads them, made once a forward (every layer uses
    it): each sequence's blocks (padded), first row in q, new tokens and context, and the query
    blocks of PREFILL_BM rows, one program each."""

    def __init__(self, block_tables: list[list[int]], query_lens: list[int], context_lens: list[int], device) -> None:
        if not all(0 < n <= c for n, c in zip(query_lens, context_lens, strict=True)):
            raise ValueError("every sequence prefills at least one token, and no more than its context holds")
        width = max(len(b) for b in block_tables)
        starts = [0]
        for n in query_lens[:-1]:
            starts.append(starts[-1] + n)
        blocks = [(s, r) for s, n in enumerate(query_lens) for r in range(0, n, PREFILL_BM)]
        b, nb = len(query_lens), len(blocks)
        ints = torch.tensor([s for s, _ in blocks] + [r for _, r in blocks] + starts + list(query_lens)
                            + list(context_lens) + [x for t in block_tables for x in t + [0] * (width - len(t))],
                            dtype=torch.int32).to(device, non_blocking=True)
        self.blocks, self.tokens = nb, sum(query_lens)
        self.blk_seq, self.blk_row = ints[:nb], ints[nb:2 * nb]
        self.q_start, self.q_len, self.ctx = ints[2 * nb:2 * nb + b], ints[2 * nb + b:2 * nb + 2 * b], \
            ints[2 * nb + 2 * b:2 * nb + 3 * b]
        self.tables = ints[2 * nb + 3 * b:].view(b, width)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan,
                      scale: float) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its whole context, read from the pages
    (a cached prefix and the new tokens alike: their k and v are in the cache already), every
    sequence in one launch. q [T, H, D] (the new tokens of each sequence in turn; rows may be
    strided); k_cache/v_cache: one layer, [num_blocks, block_size, KV, D]; plan: the batch's
    PrefillPlan. Returns [T, H * D] in q's dtype."""
    t, h, d = q.shape
    _, block_size, kv_heads, dk = k_cache.shape
    assert dk == d and h % kv_heads == 0 and q.stride(2) == 1 and q.stride(1) == d and t == plan.tokens
    out = torch.empty((t, h * d), dtype=q.dtype, device=q.device)
    _prefill_kernel[(plan.blocks, h)](q, q.stride(0), k_cache, v_cache, plan.tables, plan.tables.stride(0),
                                      plan.blk_seq, plan.blk_row, plan.q_start, plan.q_len, plan.ctx, out, scale,
                                      NUM_HEADS=h, NUM_KV_HEADS=kv_heads, GROUP=h // kv_heads, HEAD_DIM=d,
                                      BLOCK_SIZE=block_size, BM=PREFILL_BM, BN=PREFILL_BN)
    return out
