"""The decode graph's tasks, registered once per Plan (model dtype and shapes as constexprs).

The functions below are plain Python, one per node kind (kinds.py declares each kind's fields,
their types and its constexprs); `tasks_for(plan)` makes a Triton function of each (a copy named
after the plan, so each plan's tasks get their own opcodes) and registers it with its kind's
pointer types for the plan's dtype and the plan's constexprs. A Runtime started with
`tasks_for(plan).all` is then a resident kernel compiled for that one model shape: no run-time
shape arguments in the hot loops.

Pointer hints: weight matrices and the graph's own buffers are `:16` (16-byte aligned, so loads
are wide on the GPU); RMSNorm vectors too (the backend aligns them: backend.aligned_norms); biases
and KV-cache layers are not promised (kinds.py: ALIGNED, PLAIN).
"""
from __future__ import annotations

import dataclasses
import functools
import types

import triton
import triton.language as tl

import warploop
from warploop.llm.mk.attention import attn_node, combine_node, rope_attn_node, rope_kv_node
from warploop.llm.mk.gemv import EPI_OUT, EPI_RES, EPI_SILU, gemv_node
from warploop.llm.mk.gemv_tile import gemv_tile
from warploop.llm.mk.kinds import KINDS
from warploop.llm.mk.layout import Plan
from warploop.llm.mk.loop import advance_node
from warploop.llm.mk.sample import sample_combine_node, sample_tile_node
from warploop.llm.mk.tokens import embed_node


@triton.jit
def gemv(ctx, inp, w, bias, x, norm_w, out, k, n_out, f, row0, count, eps, has_bias, NORM: tl.constexpr,
         EPI: tl.constexpr, K: tl.constexpr, R: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         DEPTH: tl.constexpr, TN: tl.constexpr, TK: tl.constexpr, ONE: tl.constexpr,
         BACKEND: tl.constexpr):
    """A GEMV node: a tile of TN rows over the compile-time width K when the plan has tiles (the GPU
    plan: gemv_tile; ONE: of a batch-1 kernel), else a span of rows over the run-time width k (the CPU
    plan: gemv_node)."""
    if TN != 0:
        gemv_tile(ctx, inp, w, bias, x, norm_w, out, n_out, f, row0, count, eps, has_bias, NORM, EPI, K, TN, TK, DEPTH,
                  R, BN, BK, ONE, BACKEND)
    else:
        gemv_node(ctx, inp, w, bias, x, norm_w, out, k, n_out, f, row0, count, eps, has_bias, NORM, EPI, R, BN, BK,
                  BACKEND)


def mk_embed(inp, table, res, d, BK: tl.constexpr):
    embed_node(inp, table, res, d, BK)


def mk_qkv(ctx, inp, w, bias, res, norm_w, out, k, n_out, row0, count, eps, has_bias, R: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, KD: tl.constexpr, DEPTH: tl.constexpr, TND: tl.constexpr,
           TKD: tl.constexpr, ONE: tl.constexpr,
           BACKEND: tl.constexpr):
    gemv(ctx, inp, w, bias, res, norm_w, out, k, n_out, 0, row0, count, eps, has_bias, True, EPI_OUT, KD, R, BN, BK,
         DEPTH, TND, TKD, ONE, BACKEND)


def mk_gate_up(ctx, inp, w, bias, res, norm_w, out, k, f, row0, count, eps, has_bias, R: tl.constexpr,
               BN: tl.constexpr, BK: tl.constexpr, KD: tl.constexpr, DEPTH: tl.constexpr, TNS: tl.constexpr,
               TKS: tl.constexpr, ONE: tl.constexpr,
               BACKEND: tl.constexpr):
    gemv(ctx, inp, w, bias, res, norm_w, out, k, f, f, row0, count, eps, has_bias, True, EPI_SILU, KD, R, BN, BK,
         DEPTH, TNS, TKS, ONE, BACKEND)


# o_proj and down are one body over different widths (KQ: heads x head_dim, KF: intermediate): two
# tasks, because a task's constexprs are bound by parameter name
def mk_o_proj(ctx, inp, w, bias, x, res, k, n_out, row0, count, has_bias, R: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, KQ: tl.constexpr, DEPTH: tl.constexpr, TNQ: tl.constexpr, TKQ: tl.constexpr,
              ONE: tl.constexpr,
              BACKEND: tl.constexpr):
    gemv(ctx, inp, w, bias, x, x, res, k, n_out, 0, row0, count, 0.0, has_bias, False, EPI_RES, KQ, R, BN, BK, DEPTH,
         TNQ, TKQ, ONE, BACKEND)


def mk_down(ctx, inp, w, bias, x, res, k, n_out, row0, count, has_bias, R: tl.constexpr, BN: tl.constexpr,
            BK: tl.constexpr, KF: tl.constexpr, DEPTH: tl.constexpr, TNF: tl.constexpr, TKF: tl.constexpr,
            ONE: tl.constexpr,
            BACKEND: tl.constexpr):
    gemv(ctx, inp, w, bias, x, x, res, k, n_out, 0, row0, count, 0.0, has_bias, False, EPI_RES, KF, R, BN, BK, DEPTH,
         TNF, TKF, ONE, BACKEND)


def mk_lm_head(ctx, inp, w, res, norm_w, logits, k, vocab, row0, count, eps, R: tl.constexpr, BN: tl.constexpr,
               BK: tl.constexpr, KD: tl.constexpr, DEPTH: tl.constexpr, TND: tl.constexpr, TKD: tl.constexpr,
               ONE: tl.constexpr,
               BACKEND: tl.constexpr):
    gemv(ctx, inp, w, w, res, norm_w, logits, k, vocab, 0, row0, count, eps, 0, True, EPI_OUT, KD, R, BN, BK, DEPTH,
         TND, TKD, ONE, BACKEND)


def mk_rope_kv(inp, qkv, cos, sin, qn, kn, kc, vc, n, eps, has_qk_norm, H: tl.constexpr, KVH: tl.constexpr,
               HD: tl.constexpr, HDP: tl.constexpr, HALFP: tl.constexpr, GP1: tl.constexpr, BACKEND: tl.constexpr):
    rope_kv_node(inp, qkv, cos, sin, qn, kn, kc, vc, n, eps, has_qk_norm, H, KVH, HD, HDP, HALFP, GP1, BACKEND)


def mk_attn(inp, qkv, kc, vc, parts, lse, n, split, scale, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr,
            HDP: tl.constexpr, GP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, S: tl.constexpr,
            BACKEND: tl.constexpr):
    attn_node(inp, qkv, kc, vc, parts, lse, n, split, scale, H, KVH, HD, HDP, GP, BS, TILE, S, BACKEND)


def mk_rope_attn(ctx, inp, qkv, cos, sin, qn, kn, kc, vc, out, n, qk_eps, scale, H: tl.constexpr,
                 KVH: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr, HALFP: tl.constexpr, GP1: tl.constexpr,
                 GP: tl.constexpr, BS: tl.constexpr, TILE: tl.constexpr, BACKEND: tl.constexpr):
    rope_attn_node(ctx, inp, qkv, cos, sin, qn, kn, kc, vc, out, n, qk_eps, scale, H, KVH, HD, HDP, HALFP, GP1, GP,
                   BS, TILE, BACKEND)


def mk_combine(inp, parts, lse, out, n, H: tl.constexpr, KVH: tl.constexpr, HD: tl.constexpr, HDP: tl.constexpr,
               S: tl.constexpr, SP: tl.constexpr, BACKEND: tl.constexpr):
    combine_node(inp, parts, lse, out, n, H, KVH, HD, HDP, S, SP, BACKEND)


def mk_sample_tile(inp, logits, fstat, istat, vocab, row0, count, tile, ntiles, KC: tl.constexpr):
    sample_tile_node(inp, logits, fstat, istat, vocab, row0, count, tile, ntiles, KC)


def mk_sample_combine(inp, logits, fstat, istat, tokens, vocab, ntiles, KC: tl.constexpr):
    sample_combine_node(inp, logits, fstat, istat, tokens, vocab, ntiles, KC)


def mk_advance(inp, tokens, loop, mail, halt, BS: tl.constexpr, BACKEND: tl.constexpr):
    advance_node(inp, tokens, loop, mail, halt, BS, BACKEND)


# each kind's task function: mk_<kind>, its parameters the kind's fields and constexprs (kinds.KINDS)
FUNCTIONS = {fn.__name__.removeprefix("mk_"): fn for fn in (
    mk_embed, mk_qkv, mk_gate_up, mk_o_proj, mk_down, mk_lm_head, mk_rope_kv, mk_attn, mk_combine, mk_rope_attn,
    mk_sample_tile, mk_sample_combine, mk_advance)}


@dataclasses.dataclass(frozen=True)
class MkTasks:
    embed: object
    qkv: object
    gate_up: object
    o_proj: object
    down: object
    lm_head: object
    rope_kv: object
    attn: object
    combine: object
    rope_attn: object
    sample_tile: object
    sample_combine: object
    advance: object

    @property
    def all(self) -> list:
        return [t for t in (getattr(self, f.name) for f in dataclasses.fields(self)) if t is not None]


@functools.cache
def tasks_for(plan: Plan) -> MkTasks:
    """The plan's registered tasks (made once per plan per process)."""
    consts = plan.constexprs()
    made = {}
    for name, fn in FUNCTIONS.items():
        kind = KINDS[name]
        copy = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__)
        copy.__qualname__ = f"{fn.__qualname__}[{plan.key}]"
        copy.__module__ = fn.__module__
        made[name] = warploop.task(signature=kind.signature(plan.dtype),
                                   constexprs={c: consts[c] for c in kind.constexprs}, waits=kind.waits,
                                   heavy=True)(triton.jit(copy))
    return MkTasks(**made)
