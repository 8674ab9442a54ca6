"""Task descriptors, layouts and task registration: the data the host and the device share."""
import random

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import warploop
from warploop.runtime import layout as L
from warploop.runtime.descriptor import DESC_WORDS, MAX_ARGS, TaskDescriptor, bits_fp32, fp32_bits, join64, split64
from warploop.runtime.tasks import REGISTRY, ArgSpec, encode_value, lookup, opcode_for


@warploop.task(signature={"x": "*fp32", "n": "i32", "s": "fp32", "big": "i64"})
@triton.jit
def four_args(x, n, s, big):
    tl.store(x, n + s + big)


def test_descriptor_round_trip_random():
    rng = random.Random(3)
    for _ in range(200):
        nargs = rng.randint(0, MAX_ARGS)
        args = tuple(rng.choice([rng.randint(-2**63, 2**63 - 1), rng.randint(-5, 5), 0x7F12_3456_7890])
                     for _ in range(nargs))
        waits = tuple((rng.randint(0, 1000), rng.randint(1, 500)) for _ in range(rng.randint(0, 2)))
        d = TaskDescriptor(opcode=rng.randint(0, 2**24 - 1), args=args, node=rng.randint(-1, 10**6),
                           param_mask=rng.randint(0, 2**MAX_ARGS - 1), signal=rng.randint(-1, 99), waits=waits)
        words = d.serialize()
        assert len(words) == DESC_WORDS and all(-2**31 <= w < 2**31 for w in words)
        assert TaskDescriptor.parse(words, nargs=nargs) == d


def test_descriptor_words_are_where_the_docs_say():
    d = TaskDescriptor(opcode=300, args=(-1, 2**40 + 5), node=7, param_mask=0b10, signal=3, waits=((4, 128),))
    w = d.serialize()
    assert w[:8] == [300, 7, 2, 3, 4, 128, -1, 0]
    assert w[8:12] == [-1, -1, 5, 256]          # int64 slots, low word first
    assert np.array(w, dtype=np.int32)[8:12].view(np.int64).tolist() == [-1, 2**40 + 5]


@pytest.mark.parametrize("bad", [dict(opcode=-1), dict(opcode=2**24), dict(opcode=1, args=(0,) * 13),
                                 dict(opcode=1, waits=((0, 1),) * 3), dict(opcode=1, waits=((0, 0),)),
                                 dict(opcode=1, param_mask=1 << 12), dict(opcode=1, args=(2**64,))])
def test_descriptor_rejects_bad_fields(bad):
    with pytest.raises(ValueError):
        TaskDescriptor(**bad)


def test_word_helpers():
    for v in (0, -1, 2**63 - 1, -2**63, 0x1234_5678_9ABC):
        assert join64(*split64(v)) == v
    for f in (0.0, -2.5, 3.4e38, 1e-30):
        assert bits_fp32(fp32_bits(f)) == np.float32(f)


def test_arena_regions_are_disjoint_and_aligned():
    lay = L.ArenaLayout(workers=133, pool=1024, max_graphs=8, reserve=16, front_reserve=64)
    n = lay.slots
    assert n == 1024 + 133 * 16 + 64             # the shared pool, each worker's reserve, the front's
    regions = [(0, L.HEADER_WORDS), (lay.ctl, lay.ctl + L.N_CTL * L.LINE),
               (lay.ctx, lay.ctx + 133 * L.CTX_WORDS), (lay.pool_desc, lay.pool_desc + n * DESC_WORDS),
               (lay.pool_meta, lay.pool_meta + 2 * L.N_META64 * n), (lay.pool_i32, lay.pool_i32 + 2 * n),
               (lay.ring_off, lay.ring_off + 2 * lay.ring), (lay.graphs, lay.words)]
    for (a0, a1), (b0, b1) in zip(regions, regions[1:], strict=False):
        assert a1 <= b0, (a0, a1, b0, b1)
    for off in (lay.pool_desc, lay.pool_meta, lay.ring_off, lay.graphs):
        assert off % 2 == 0                      # int64 regions
    assert lay.pool_desc % 32 == 0               # descriptors on 128-byte lines
    assert L.ArenaLayout.parse(lay.header(0x1000, 0, 64)) == lay
    with pytest.raises(ValueError, match="power of two"):
        L.ArenaLayout(workers=1, pool=1000)


def test_host_layout_offsets():
    hl = L.HostLayout(submit_slots=16)
    assert hl.greq >= L.HB_ERROR + 8
    assert hl.submit == hl.greq + L.GREQ_SLOTS * L.GREQ_WORDS
    assert hl.completions == hl.submit + 16 * L.SUBMIT_SLOT_WORDS
    assert hl.submit % 2 == 0 and hl.completions % 2 == 0


def test_task_registration_records_layout():
    t = lookup(four_args)
    assert four_args.opcode == t.opcode == opcode_for(t.name) >= 256
    assert REGISTRY[t.opcode] is t
    assert [a.type for a in t.args] == ["*fp32", "i32", "fp32", "i64"]
    assert four_args.kinds[:5] == (1, 2, 3, 2, 0) and len(four_args.kinds) == MAX_ARGS
    x = torch.zeros(1)
    assert t.encode((x, -3, 1.5, 2**40)) == (x.data_ptr(), -3, fp32_bits(1.5), 2**40)
    with pytest.raises(OverflowError):
        t.encode((x, 2**31, 1.0, 0))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        t.encode((x,))


def test_alignment_hint_is_checked_on_the_host():
    w, k = ArgSpec("w", "*bf16:16"), ArgSpec("k", "i32:16")
    assert (w.base, w.aligned, w.kind) == ("*bf16", True, ArgSpec("v", "*bf16").kind)
    assert encode_value(w, 4096) == 4096 and encode_value(k, 2048) == 2048
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_value(w, 4098)
    with pytest.raises(ValueError, match="multiple of 16"):
        encode_value(k, 24)
    for bad in ("*bf16:8", "fp32:16", "*bf17:16"):
        with pytest.raises(ValueError):
            ArgSpec("a", bad)


def test_task_registration_errors_name_the_fix():
    def jit(src_fn):
        return triton.jit(src_fn)

    def missing(x, n):
        pass

    with pytest.raises(TypeError, match="parameter 'n' needs a type"):
        warploop.task(signature={"x": "*fp32"})(jit(missing))
    with pytest.raises(TypeError, match="not parameters"):
        warploop.task(signature={"x": "*fp32", "n": "i32", "q": "i32"})(jit(missing))
    with pytest.raises(ValueError, match="unsupported type"):
        warploop.task(signature={"x": "*fp32", "n": "u16"})(jit(missing))
    with pytest.raises(TypeError, match="on top of @triton.jit"):
        warploop.task(signature={"x": "*fp32", "n": "i32"})(missing)


def test_submit_fast_path_writes_the_serialized_descriptor():
    with warploop.Runtime(device="cpu", tasks=[four_args], workers=1) as rt:
        x = torch.zeros(1)
        rt.submit(four_args, x, 7, 0.5, -2)
        base = rt._hl.submit
        slot = rt._h[base + L.SLOT_DESC:base + L.SLOT_DESC + DESC_WORDS].tolist()
        expected = TaskDescriptor(four_args.opcode, (x.data_ptr(), 7, fp32_bits(0.5), -2)).serialize()
        assert slot == expected
        assert rt._h[base] == 1
