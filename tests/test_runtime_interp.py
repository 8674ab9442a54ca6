"""The interpreter bridge (warploop.runtime.interp): launches after the first patch the language from
a record of what Triton's own patching set, give the same results, and leave the language untouched."""
import torch
import triton
import triton.language as tl

from warploop.runtime import interp


@triton.jit
def _twice(x):
    return x * 2


@triton.jit
def _scale(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, _twice(tl.load(src + offs, mask=mask)) + 1.0, mask=mask)


def _untouched() -> bool:
    return all(tl.core.is_builtin(f) for f in (tl.load, tl.store, tl.core.tensor.__add__, tl.math.exp))


def test_repeated_launches_patch_from_the_record_and_restore_the_language():
    src = torch.arange(10, dtype=torch.float32)
    for round_ in range(3):        # the first records, the others replay
        dst = torch.zeros(16)
        interp.launch(_scale, (1,), src, dst, 10, BLOCK=16)
        assert dst[:10].tolist() == (src * 2 + 1).tolist() and dst[10:].eq(0).all(), round_
        assert _untouched(), "the language stayed patched after a launch"
    assert interp._lang_records, "no launch recorded its patches"
