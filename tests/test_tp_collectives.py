"""Tensor parallelism's collectives on the CPU: the choice of all-reduce (warploop/llm/tp/allreduce.py:
gloo always takes torch.distributed.all_reduce; symmetric memory where it cannot work, a second
symm engine in one process or an unknown mode is refused naming the variable and the fix, before
any rank starts; tests/test_tp_gpu.py runs both modes on two GPUs), and leaving the group, which
gives up after its bound instead of hanging."""
from __future__ import annotations

import pytest
import torch

from warploop.llm.tp.allreduce import AllReduce, mode_from_env

CPU = torch.device("cpu")


def test_the_default_is_torch_distributed(monkeypatch):
    monkeypatch.delenv("WARPLOOP_TP_ALLREDUCE", raising=False)
    assert mode_from_env() == "auto"
    assert AllReduce(CPU, torch.float32, 64).mode == "nccl"


def test_symm_where_it_cannot_work_is_refused(monkeypatch):
    monkeypatch.setenv("WARPLOOP_TP_ALLREDUCE", "symm")
    with pytest.raises(ValueError, match="WARPLOOP_TP_ALLREDUCE=symm needs NVIDIA GPUs"):
        AllReduce(CPU, torch.bfloat16, 64)


def test_unknown_mode_is_refused(monkeypatch):
    monkeypatch.setenv("WARPLOOP_TP_ALLREDUCE", "fast")
    with pytest.raises(ValueError, match="choose one of auto, nccl, symm"):
        mode_from_env()
    monkeypatch.setenv("WARPLOOP_TP_ALLREDUCE", " NCCL ")
    assert mode_from_env() == "nccl"


def test_a_bad_mode_fails_before_any_rank_starts(monkeypatch):
    """build_tp_backend checks the variable before it spawns a worker (no process to clean up)."""
    from warploop.llm.loader import load_config, resolve_model_dir
    from warploop.llm.tp import group
    from warploop.llm.tp.build import RankJob, build_tp_backend

    started = []
    monkeypatch.setattr(group, "Ranks", lambda *a, **k: started.append(a))
    monkeypatch.setenv("WARPLOOP_TP_ALLREDUCE", "symm")
    cfg = load_config(resolve_model_dir("tiny"))
    job = RankJob(cfg, None, "float32", block_size=16, num_kv_blocks=8, max_num_seqs=2, max_len=64,
                  use_cuda_graphs=False)
    with pytest.raises(ValueError, match="symm needs NVIDIA GPUs"):
        build_tp_backend(cfg, 2, CPU, job)
    assert not started


def test_a_second_symmetric_memory_engine_is_refused(monkeypatch):
    """A process that already set up symmetric memory refuses a second symm engine at once (its
    rendezvous waited forever on two H100s), naming the fix."""
    from warploop.llm.tp import allreduce

    monkeypatch.setattr(allreduce, "_SET_UP", ["0"])
    monkeypatch.setenv("WARPLOOP_TP_ALLREDUCE", "symm")
    with pytest.raises(RuntimeError, match="one tensor-parallel engine per process.*use nccl"):
        allreduce.check_mode(torch.device("cuda", 0), torch.bfloat16)


def test_leaving_a_group_that_hangs_gives_up_with_a_warning(monkeypatch):
    """group.leave: NCCL's teardown once hung (a captured graph holding the communicator, a peer not
    leaving); closing an engine waits at most its bound, then warns and goes on."""
    import threading
    import time

    import torch.distributed as dist

    from warploop.llm.tp import group

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    with pytest.warns(RuntimeWarning, match="did not return within 0 s"):
        group.leave(timeout=0.3)
    assert 0.25 < time.monotonic() - t0 < 5
    release.set()
