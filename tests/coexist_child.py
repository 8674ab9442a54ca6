"""Run as a fresh process by test_runtime_coexist_gpu.py: torch and other CUDA work, none of it used
before, while a warploop Runtime is open. Prints one line per step; exits 0 only if all completed.

    python tests/coexist_child.py [torch-first|runtime-first]

The parent sets CUDA_MODULE_LOADING (unset, LAZY, EAGER) and a deadline: a hang is a failure.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import warploop
from warploop.bench.runtime_kernels import tick


@triton.jit
def _double(x, y, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y + o, tl.load(x + o, mask=o < n) * 2, mask=o < n)


def _graph_replay() -> float:
    x = torch.ones(1024, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s):
        with torch.cuda.graph(g, stream=s):
            x.mul_(3.0)
        g.replay()
    s.synchronize()
    return float(x[0].item())


def _triton_fresh() -> float:
    x = torch.ones(4096, device="cuda")
    y = torch.empty_like(x)
    _double[(4,)](x, y, 4096, BLOCK=1024)
    return float(y.sum().item())


def _bundle_launch(path: Path) -> float:
    b = warploop.load_bundle(path)
    x, y = torch.ones(10_000, device="cuda"), torch.full((10_000,), 2.0, device="cuda")
    out = torch.zeros_like(x)
    b.add[(10,)](x, y, out, 10_000)
    return float(out.sum().item())


STEPS = [
    ("randn", lambda: float(torch.randn(1 << 20, device="cuda").abs().mean().item())),
    ("add", lambda: float((torch.arange(100, device="cuda") + 1).sum().item())),
    ("matmul_bf16", lambda: float((torch.ones(256, 256, device="cuda", dtype=torch.bfloat16)
                                   @ torch.ones(256, 256, device="cuda", dtype=torch.bfloat16))[0, 0].item())),
    ("sort", lambda: float(torch.sort(torch.rand(100000, device="cuda"))[0][-1].item())),
    ("triton_fresh", _triton_fresh),
    ("cuda_graph_side_stream", _graph_replay),
    ("empty_cache", lambda: torch.cuda.empty_cache()),
    ("device_sync", lambda: torch.cuda.synchronize()),
]


def main(order: str) -> int:
    from warploop.bundle.build import build_bundle
    from warploop.target import select_device

    bundle = Path(tempfile.mkdtemp()) / "add.wlb"
    build_bundle(Path(__file__).resolve().parents[1] / "examples" / "kernels.py", [str(select_device().target)],
                 bundle, jobs=1, progress=False, only=["add"])
    STEPS.insert(5, ("bundle_launch", lambda: _bundle_launch(bundle)))
    if order == "torch-first":
        torch.zeros(1, device="cuda")
    rt = warploop.Runtime(tasks=[tick], timeout=30)
    counter = torch.zeros(1, dtype=torch.int32, device="cuda")     # created after the runtime started
    for i, (label, fn) in enumerate(STEPS):
        t = time.perf_counter()
        out = fn()
        rt.submit(tick, counter).result(timeout=30)                  # the runtime keeps working between them
        print(f"ok {label} {1e3 * (time.perf_counter() - t):.1f} ms {out}", flush=True)
        assert int(counter.item()) == i + 1, (label, int(counter.item()))
    relaunches = rt._backend.relaunches
    rt.close()
    print(f"done relaunches={relaunches}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runtime-first"))
