"""Decode and prefill attention straight from the paged KV cache (kernels in ops_kernels.py,
launched by ops_prebuilt from the shipped bundle or through Triton's JIT; importing this module
imports no Triton).

Decode is flash-decoding with split-K. Grid (sequence, kv head, split): each program takes the query
heads that share one KV head (a GQA group, or 16 of a larger one; padded to 16 rows for tl.dot) over
one PARTITION of the context, walking it in TILE-token steps through the block table, so any block
size works. A second kernel merges the splits by their log-sum-exp. Both grids are fixed by the
batch size and the longest context, so the pair can be captured in a CUDA graph and replayed for any
mix of context lengths. Dots use input_precision "ieee": float32 models stay exact (no tf32), and
bf16/fp16 operands use the tensor cores anyway.
"""
from __future__ import annotations

import torch

from warploop.llm.ops_prebuilt import launch

# as ops_kernels.py exports them (tests/test_ops_prebuilt.py checks it); the tests shrink PARTITION
# and PREFILL_BM/BN to reach several splits and blocks at small sizes (the JIT then compiles those)
TILE = 64
PARTITION = 512
GROUP_ROWS = 16          # query heads a decode program takes (tl.dot's smallest M)
MERGE_SPLITS = 16        # splits the merge reads at a time


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


class DecodeWorkspace:
    """Scratch for the split results, sized once for the batch and the longest context."""

    def __init__(self, max_batch: int, num_heads: int, head_dim: int, max_context: int, device) -> None:
        self.max_splits = cdiv(max_context, PARTITION)
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
    launch("decode_split_kernel", (b, kv_heads * cdiv(group, GROUP_ROWS), workspace.max_splits),
           (q, q.stride(0), k_cache, v_cache, block_tables, block_tables.stride(0), context_lens, workspace.out,
            workspace.lse, scale, workspace.max_splits, kv_heads, group, block_size),
           {"GROUP_PAD": GROUP_ROWS, "HEAD_DIM": d, "TILE": TILE, "PARTITION": PARTITION})
    launch("decode_merge_kernel", (b, h), (workspace.out, workspace.lse, context_lens, out, workspace.max_splits, h),
           {"HEAD_DIM": d, "PARTITION": PARTITION, "SPLITS": MERGE_SPLITS})
    return out


PREFILL_BM = 128         # new tokens a program takes (its query rows)
PREFILL_BN = 64          # context tokens a step
PREFILL_WARPS = 8


class PrefillPlan:
    """A prefill batch's sequences as the kernel reads them, made once a forward (every layer uses
    it): each sequence's blocks (padded), first row in q, new tokens and context, and the query
    blocks of PREFILL_BM rows, one program each. One int32 device buffer holds it, laid out by
    plan_ints: [block's sequence (nb) | block's first row (nb) | q start (b) | q len (b) | context (b)
    | block tables (b x width)]."""

    def __init__(self, block_tables: list[list[int]], query_lens: list[int], context_lens: list[int], device) -> None:
        width = max(len(b) for b in block_tables)
        nb = sum(cdiv(n, PREFILL_BM) for n in query_lens)
        ints = torch.tensor(plan_ints(block_tables, query_lens, context_lens, nb, len(query_lens), width),
                            dtype=torch.int32).to(device, non_blocking=True)
        self._view(ints, nb, len(query_lens), width, sum(query_lens))

    @classmethod
    def over(cls, ints: torch.Tensor, blocks: int, seqs: int, width: int, tokens: int) -> PrefillPlan:
        """A plan read from `ints` (a device buffer plan_ints fills with these capacities): a CUDA
        graph's, whose launches keep their grid (`blocks`) while the batch changes."""
        plan = cls.__new__(cls)
        plan._view(ints, blocks, seqs, width, tokens)
        return plan

    def _view(self, ints: torch.Tensor, nb: int, b: int, width: int, tokens: int) -> None:
        self.blocks, self.tokens = nb, tokens
        self.blk_seq, self.blk_row = ints[:nb], ints[nb:2 * nb]
        self.q_start, self.q_len, self.ctx = ints[2 * nb:2 * nb + b], ints[2 * nb + b:2 * nb + 2 * b], \
            ints[2 * nb + 2 * b:2 * nb + 3 * b]
        self.tables = ints[2 * nb + 3 * b:2 * nb + 3 * b + b * width].view(b, width)


def plan_size(blocks: int, seqs: int, width: int) -> int:
    return 2 * blocks + 3 * seqs + seqs * width


def plan_ints(block_tables: list[list[int]], query_lens: list[int], context_lens: list[int], blocks: int,
              seqs: int, width: int) -> list[int]:
    """PrefillPlan's buffer for these sequences, at capacities of `blocks` query blocks and `seqs`
    sequences (each table padded to `width`). Blocks past the batch's go to the last sequence slot,
    which must then be a spare one: no new tokens and no context, so its programs read nothing and
    write nothing."""
    if not all(0 < n <= c for n, c in zip(query_lens, context_lens, strict=True)):
        raise ValueError("every sequence prefills at least one token, and no more than its context holds")
    b = len(query_lens)
    pairs = [(s, r) for s, n in enumerate(query_lens) for r in range(0, n, PREFILL_BM)]
    if len(pairs) > blocks or b > seqs or max(len(t) for t in block_tables) > width or (len(pairs) < blocks
                                                                                         and b == seqs):
        raise ValueError(f"a prefill plan of {len(pairs)} blocks, {b} sequences does not fit {blocks}, {seqs}")
    spare = [(seqs - 1, 0)] * (blocks - len(pairs))
    starts = [0]
    for n in query_lens[:-1]:
        starts.append(starts[-1] + n)
    pad = [0] * (seqs - b)
    return ([s for s, _ in pairs + spare] + [r for _, r in pairs + spare] + starts + pad + list(query_lens) + pad
            + list(context_lens) + pad + [x for t in block_tables for x in t + [0] * (width - len(t))]
            + [0] * ((seqs - b) * width))


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
    launch("prefill_kernel", (plan.blocks, h),
           (q, q.stride(0), k_cache, v_cache, plan.tables, plan.tables.stride(0), plan.blk_seq, plan.blk_row,
            plan.q_start, plan.q_len, plan.ctx, out, scale, h, kv_heads, h // kv_heads, block_size),
           {"HEAD_DIM": d, "BM": PREFILL_BM, "BN": PREFILL_BN}, num_warps=PREFILL_WARPS)
    return out
