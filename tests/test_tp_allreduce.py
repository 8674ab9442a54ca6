"""The choice of all-reduce for tensor parallelism (warploop/llm/tp/allreduce.py), on the CPU: gloo
always takes torch.distributed.all_reduce; asking for symmetric memory where it cannot work, or for
an unknown mode, is refused naming the variable and the choices. (tests/test_tp_gpu.py runs both
modes over NCCL.)"""
from __future__ import annotations

import pytest
import torch

from warploop.llm.tp.allreduce import AllReduce, mode_from_env

CPU = torch.device("cpu")


def test_auto_on_the_cpu_is_torch_distributed(monkeypatch):
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
