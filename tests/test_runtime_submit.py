"""The submit path: self-checking completion records, results that need all 64 bits, the submit
stamps and their breakdown (on the CPU executor; the GPU test reads real device stamps)."""
import pytest
import torch
import triton
import triton.language as tl  # noqa: F401  (the interpreter looks it up in the task's module)

import warploop
from warploop.bench.runtime_kernels import HOP_TASKS, noop
from warploop.bench.runtime_submit import STAGES, bus_floor, submit_breakdown
from warploop.runtime import device as wl
from warploop.runtime import layout as L
from warploop.runtime.descriptor import TaskDescriptor
from warploop.runtime.errors import TaskError
from warploop.runtime.host import Future

BIG = -(2**62) - 12345          # high and low halves both matter, and the sign


@warploop.task(signature={"v": "i64"})
@triton.jit
def give(ctx, v):
    wl.set_result(ctx, v)


def test_results_cross_in_three_self_checking_words():
    with warploop.Runtime(device="cpu", tasks=[give], workers=1, submit_slots=4) as rt:
        values = [BIG, 2**63 - 1, -1, 0, 1 << 32, (1 << 32) - 1]
        futures = [rt.submit(give, v) for v in values]          # wraps the 4-slot ring
        assert [f.result(timeout=60) for f in futures] == values


def _signed(word: int) -> int:
    word &= (1 << 64) - 1
    return word - (1 << 64) if word >> 63 else word


def test_a_record_counts_only_once_every_word_carries_its_sequence():
    with warploop.Runtime(device="cpu", tasks=[give], workers=1, submit_slots=2) as rt:
        rec = (rt._hl.completions + 1 * L.COMPLETION_WORDS) // 2
        f = Future(rt, 3, "give", rec)                           # ticket 3 -> sequence 4
        words = [_signed(4 | (-7 << 32)), _signed(4 | ((BIG & 0xFFFFFFFF) << 32)), _signed(4 | ((BIG >> 32) << 32))]
        for missing in range(3):                                 # any word still from the slot's last use
            for i, w in enumerate(words):
                rt._w64[rec + i] = 2 | (5 << 32) if i == missing else w
            assert not f.done()
        for i, w in enumerate(words):
            rt._w64[rec + i] = w
        assert f.done() and f._status == -7 and f._value == BIG


def test_breakdown_on_the_cpu_reports_host_figures_and_no_device_stages():
    with warploop.Runtime(device="cpu", tasks=HOP_TASKS, workers=1) as rt:
        out = submit_breakdown(rt, rounds=3, task=noop)
        assert out["host_total"]["p50_us"] > 0 and out["host_own"]["p50_us"] > 0
        assert out["stamped_rounds"] == 0 and set(out["stages"]) == {name for name, _, _ in STAGES}
        assert rt.submit(noop).result(timeout=60) == 0            # still serving


def test_stamps_fit_the_spare_words_of_their_control_line():
    assert L.STAMP_ON < L.STAMP_BASE and L.STAMP_BASE % 2 == 0
    assert L.STAMP_BASE + 2 * len(L.STAMP_NAMES) <= L.LINE
    assert len(L.STAMP_NAMES) == L.ST_DONE_TICKET + 1


def test_a_failed_task_reports_its_status_through_the_record():
    with warploop.Runtime(device="cpu", tasks=[give], workers=1) as rt:
        with pytest.raises(TaskError, match="invalid opcode"):
            rt.submit_descriptor(TaskDescriptor(opcode=12345)).result(timeout=60)
        assert rt.submit(give, 9).result(timeout=60) == 9


@pytest.mark.gpu
def test_gpu_breakdown_has_device_stages():
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    floor = bus_floor()                 # before the runtime: a module load would wait for it
    with warploop.Runtime(device="cuda", tasks=HOP_TASKS + [give], workers=8, worker_warps=1) as rt:
        assert rt.submit(give, BIG).result(timeout=10) == BIG
        out = submit_breakdown(rt, rounds=50, task=noop, floor=floor)
        assert out["stamped_rounds"] >= 40
        for name in ("poll_read", "desc_read", "alloc_push", "device_total"):
            assert out["stages"][name]["p50_us"] > 0, name
        assert out["bus_floor"]["host_read_us"] > out["bus_floor"]["device_read_us"] > 0
