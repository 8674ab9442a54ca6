"""The ranks' processes and their torch.distributed group.

Rank 0 is the calling process: it runs the engine and samples. Ranks 1..N-1 are started here with
multiprocessing's spawn (a fresh interpreter: CUDA state never crosses a fork), one per device. Each
worker talks to rank 0 over a Pipe (control: what to run next, replies while starting) and to every
rank over torch.distributed (tensors: gloo on the CPU, NCCL on GPUs). The rendezvous is a TCPStore on
loopback whose port the OS picks, so two groups on one machine never collide.

Every wait is bounded: start-up replies by STARTUP_TIMEOUT_S with the workers' liveness checked
while waiting, collectives by COLLECTIVE_TIMEOUT_S, and an idle worker polls its pipe and exits when
rank 0 has gone.
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable

STARTUP_TIMEOUT_S = 600.0     # spawn, import torch, read a shard, compile and capture: minutes for 70B
COLLECTIVE_TIMEOUT_S = 300.0  # one collective; a peer stuck longer fails the step
JOIN_TIMEOUT_S = 30.0
POLL_S = 0.5
NVLS_OFF = {"NCCL_NVLS_ENABLE": "0"}  # NVLink multicast stays off on the lent machines (KINDS.md)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    world: int
    device_type: str   # "cpu" | "cuda" (ROCm builds of torch also say cuda; NCCL is then RCCL)
    store_port: int


def rank_device(spec: GroupSpec, rank: int):
    import torch

    return torch.device("cuda", rank) if spec.device_type == "cuda" else torch.device("cpu")


def init_rank(spec: GroupSpec, rank: int, store=None) -> None:
    """Join the group as `rank` (rank 0 passes the store it serves)."""
    import torch
    import torch.distributed as dist

    os.environ.update(NVLS_OFF)
    timeout = datetime.timedelta(seconds=STARTUP_TIMEOUT_S)
    if store is None:
        store = dist.TCPStore("127.0.0.1", spec.store_port, spec.world, is_master=False, timeout=timeout)
    if spec.device_type == "cuda":
        torch.cuda.set_device(rank)
    else:  # N ranks share the cores; more threads each would only contend in lockstep
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))
    dist.init_process_group("nccl" if spec.device_type == "cuda" else "gloo", store=store, rank=rank,
                            world_size=spec.world, timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))


class RankFailed(RuntimeError):
    """A worker rank reported an error or exited."""


class Ranks:
    """Rank 0's handle on the group: starts the workers, joins the group, talks to the workers."""

    def __init__(self, world: int, device_type: str, worker: Callable, job: object) -> None:
        import multiprocessing

        import torch.distributed as dist

        if dist.is_initialized():
            raise RuntimeError("this process already belongs to a torch.distributed group (another "
                               "tensor-parallel engine still open?); close it first")
        os.environ.update(NVLS_OFF)  # inherited by the workers; read by NCCL in this process too
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=STARTUP_TIMEOUT_S))
        self.spec = GroupSpec(world, device_type, store.port)
        ctx = multiprocessing.get_context("spawn")
        self.procs, self.conns = [], []
        self._closed = False
        try:
            for rank in range(1, world):
                mine, theirs = ctx.Pipe()
                proc = ctx.Process(target=worker, args=(self.spec, rank, theirs, job), daemon=True,
                                   name=f"warploop-tp-rank{rank}")
                proc.start()
                theirs.close()
                self.procs.append(proc)
                self.conns.append(mine)
            self.replies()   # every worker is up before joining: a failed start errors, never waits it out
            init_rank(self.spec, 0, store)
        except BaseException:
            self.close()
            raise

    def send(self, message: tuple) -> None:
        for conn in self.conns:
            conn.send(message)

    def check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, 1):
            if not proc.is_alive():
                raise RankFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}; "
                                 "restart the engine")

    def replies(self, timeout: float = STARTUP_TIMEOUT_S) -> list:
        """One reply from every worker, in rank order (a worker's ("error", text) raises RankFailed)."""
        deadline = time.monotonic() + timeout
        out = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs, strict=True), 1):
            while not conn.poll(POLL_S):
                if not proc.is_alive() and not conn.poll(0):
                    raise RankFailed(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code "
                                     f"{proc.exitcode} while starting; see its output above")
                if time.monotonic() > deadline:
                    raise RankFailed(f"tensor-parallel rank {rank} did not answer within {timeout:.0f} s")
            kind, value = conn.recv()
            if kind == "error":
                raise RankFailed(f"tensor-parallel rank {rank}: {value}")
            out.append(value)
        return out

    def close(self) -> None:
        """Stop the workers (politely, then by force) and leave the group; idempotent. Rank 0 leaves
        while the workers leave: NCCL's teardown can wait for every rank's (measured on two H100s:
        a worker's destroy waited out its 30 s bound while rank 0 waited for that worker to exit)."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            try:
                conn.send(("close", None))
            except OSError:   # that worker is already gone
                pass
        leave()
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        for conn in self.conns:
            conn.close()


def leave(timeout: float = JOIN_TIMEOUT_S) -> None:
    """Leave the group (destroy_process_group), giving up after `timeout` seconds with a warning:
    NCCL's communicator destroy can wait on a peer or on a CUDA graph still holding it, and closing
    an engine must not hang its process."""
    import threading
    import warnings

    import torch.distributed as dist

    if not dist.is_initialized():
        return
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        finally:
            done.set()

    threading.Thread(target=destroy, daemon=True, name="warploop-tp-leave").start()
    if not done.wait(timeout):
        warnings.warn(f"torch.distributed.destroy_process_group() did not return within {timeout:.0f} s; "
                      "leaving the process group behind", RuntimeWarning, stacklevel=2)


def worker_loop(conn, handle: Callable[[str, object], object | None]) -> None:
    """A worker's control loop: run `handle(kind, value)` per message until ("close", _) or rank 0 is
    gone. A handler's non-None result is sent back as ("ok", result); an exception as ("error", text)."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    while True:
        if not conn.poll(POLL_S):
            if parent is not None and not parent.is_alive():
                return
            continue
        try:
            kind, value = conn.recv()
        except EOFError:   # rank 0 closed its end
            return
        if kind == "close":
            return
        try:
            result = handle(kind, value)
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            raise
        if result is not None:
            conn.send(("ok", result))
