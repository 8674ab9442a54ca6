"""The device sampler's noise: runtime/stream/philox.py's numpy Philox and Gumbel numbers equal
Triton's own tl.philox and uint_to_uniform_float (the megakernel's sampler, llm/mk/sample.py), run by
the Triton interpreter in a child process (TRITON_INTERPRET must be set before a kernel is defined);
and Gumbel-max over them draws tokens with softmax(logits / T)'s frequencies."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from warploop.runtime.stream import philox

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import numpy as np, torch, triton, triton.language as tl
from warploop.runtime.stream import philox

@triton.jit
def k(out, seed, counter, N: tl.constexpr):
    idx = tl.arange(0, N)
    r, _, _, _ = tl.philox(seed, idx, tl.zeros_like(idx) + counter, tl.zeros_like(idx), tl.zeros_like(idx))
    tl.store(out + idx, -tl.log(-tl.log(tl.uint_to_uniform_float(r))))

for seed, counter in ((7, 12), (2 ** 63 + 5, 2 ** 31 - 1), (123456789012345, 0), (2 ** 64 - 1, 77)):
    out = torch.empty(256)
    k[(1,)](out, seed, counter, N=256)
    assert np.array_equal(out.numpy(), philox.gumbel(seed, counter, np.arange(256))), (seed, counter)
print("same")
"""


def test_the_reference_draws_tritons_philox_numbers():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-3000:]


def test_gumbel_max_draws_softmax_frequencies():
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, 1.5], np.float32)
    temperature, draws = 0.7, 6000
    want = np.exp(logits / temperature) / np.exp(logits / temperature).sum()
    picks = np.array([int(np.argmax(logits / temperature + philox.gumbel(seed, 40, np.arange(6))))
                      for seed in range(draws)])
    got = np.bincount(picks, minlength=6) / draws
    assert np.abs(got - want).max() < 0.02, (got, want)     # 3 standard deviations of the largest p is 0.019
    counters = {int(np.argmax(philox.gumbel(5, c, np.arange(1000)))) for c in range(20)}
    assert len(counters) > 15                               # each step's noise is new
