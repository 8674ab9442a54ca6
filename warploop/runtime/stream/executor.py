"""Run a streaming program on a Hopper GPU: upload once, then one launch of the persistent kernel
per run (one CTA per SM). Counters only grow, so a run needs no reset: run e waits for need * (e + 1).

    ex = StreamExecutor(program)        # builds, uploads, compiles (Gluon; about a second)
    ex.run()                            # raises StreamError if a wait gave up, TimeoutError if the GPU hangs
    ex.arena                            # the fp32 arena on the GPU
    ex2 = StreamExecutor(program2, share=ex)   # another program over ex's arena, int arena, cache and pools

Programs that share an executor's memory declare the same regions (a variant of one graph: the same
buffers, other nodes); each keeps its own instructions and counters. Their launches go to one stream,
one after another.
"""
from __future__ import annotations

import time

from warploop.runtime.stream.compiled import smem_layout
from warploop.runtime.stream.kinds import TRACE_STAMPS
from warploop.runtime.stream.program import StreamProgram

RESET_EPOCH = 1 << 20                   # counters are zeroed at least this often (runs)
MIN_RESET = 1 << 10                     # a program whose counters overflow sooner is refused


def reset_interval(counter_sizes) -> int:
    """Runs between counter resets: a counter grows by its signallers a run (an lm_head's thousands of
    tiles feed one), and a wait compares against need * (epoch + 1) in int32, so they are zeroed
    before that could overflow; a program with too many signallers on one counter is refused."""
    runs = min(RESET_EPOCH, (2 ** 31 - 1) // max(1, max(counter_sizes, default=1)) - 1)
    if runs < MIN_RESET:
        raise ValueError(f"a counter with {max(counter_sizes)} signallers a run overflows int32 within "
                         f"{MIN_RESET} runs; split the stage")
    return runs


class StreamError(RuntimeError):
    pass


def _check_shareable(program: StreamProgram, other: StreamProgram) -> None:
    """Refuse to run `program` over `other`'s memory unless both declare the same regions, cache,
    embedding, pools and kernel shape."""
    same = (program.config == other.config and program.floats.regions == other.floats.regions
            and program.ints_space.regions == other.ints_space.regions and program.kv is other.kv
            and program.emb is other.emb and len(program.pools) == len(other.pools)
            and all(a is b for a, b in zip(program.pools, other.pools, strict=True)))
    if not same:
        raise ValueError("an executor shares another's memory only for a program with the same regions, KV cache, "
                         "embedding, pools and StreamConfig (a variant of the same graph)")


def _check_tensor_parallel(program: StreamProgram, group) -> None:
    """A program's all-reduce nodes, its kernel's all-reduce body and the ranks' group agree."""
    reduces = [n for n in program.nodes if n.kind.name == "allreduce"]
    if bool(reduces) != program.config.tensor_parallel:
        raise ValueError("a program with all-reduce nodes needs StreamConfig(tensor_parallel=True), and only it"
                         if reduces else "StreamConfig.tensor_parallel is for a program with all-reduce nodes")
    if reduces and group is None:
        raise ValueError(f"node {reduces[0].index} all-reduces over {reduces[0].fields['world']} ranks: pass the "
                         "ranks' torch.distributed group (tp_group)")
    if reduces:
        import torch.distributed as dist
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        f = reduces[0].fields
        if (f["world"], f["rank"]) != (world, rank):
            raise ValueError(f"the program is rank {f['rank']} of {f['world']}, the group's process rank {rank} of "
                             f"{world}")
        # a rank reads its peers' src at its own offsets: every rank's all-reduces must be laid out alike
        # (the regions after them may differ: rank 0 alone holds the row-parallel biases)
        layout = [(n.fields["src"], n.fields["out"], n.fields["n"]) for n in reduces]
        layouts = [None] * world
        dist.all_gather_object(layouts, layout, group=group)
        if any(other != layout for other in layouts):
            raise ValueError("the ranks' programs place their all-reduce regions differently: declare every region "
                             "an all-reduce reads before any region whose size differs from rank to rank")


def _symmetric(tensor, group):
    """A copy of `tensor` in symmetric memory every rank of `group` maps, and every rank's address
    of its copy, in rank order (a collective: every rank calls it in the same order). The ranks'
    tensors may differ in size (rank 0's arena holds the row-parallel biases): every rank allocates
    the largest, as the rendezvous needs one size."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None and getattr(enable, "__deprecated__", None) is None:
        enable(group.group_name)        # older torch needs it; newer ones deprecate it
    sizes = [None] * dist.get_world_size(group)
    dist.all_gather_object(sizes, tensor.numel(), group=group)
    out = symm_mem.empty(max(sizes), dtype=tensor.dtype, device=tensor.device)
    mine = out[:tensor.numel()]
    mine.copy_(tensor.reshape(-1))
    handle = symm_mem.rendezvous(out, group)
    return mine.view(tensor.shape), [int(p) for p in handle.buffer_ptrs]


class StreamExecutor:
    def __init__(self, program: StreamProgram, device="cuda", ctas: int | None = None,
                 share: StreamExecutor | None = None, check: bool = True, prebuilt=None,
                 build_cache=None, tp_group=None) -> None:
        """share: an executor whose arena, int arena, KV cache, embedding and pools this one runs
        over (its program declares the same regions, the same cache and pools). check: the
        program's hazard check (StreamProgram.build). prebuilt: a folder of prebuilt kernels
        (prebuilt.py); its variant of the program's StreamConfig launches through the CUDA driver
        with no Triton, and a folder without one is an error. build_cache: a folder of placed
        programs (StreamProgram.build's cache), so a later start skips placement.
        tp_group: a tensor-parallel rank's program (all-reduce nodes, StreamConfig.tensor_parallel):
        the torch.distributed group of the ranks (one process and GPU each, NVLink between them),
        every rank building its executors in the same order, as setting up their symmetric memory
        is a collective."""
        import torch
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type != "cuda" or torch.cuda.get_device_capability(dev)[0] != 9:
            raise RuntimeError("the streaming executor needs a Hopper GPU (compute capability 9.x); "
                               "elsewhere run the program with reference.reference()")
        _check_tensor_parallel(program, tp_group)
        most = max(program.config.batch_rows, 1)
        batched = [n.index for n in program.nodes if n.kind.name == "gemv" and n.fields["batch"] > most]
        if batched:
            raise ValueError(f"node {batched[0]} is a GEMV of batch {program.nodes[batched[0]].fields['batch']}: the "
                             f"kernel is compiled for {most} row(s) (StreamConfig.batch_rows 16, 32 or 64 for batches)")
        unaligned = [n.index for n in program.nodes if n.kind.name == "gemv" and n.fields["batch"] > 1
                     and n.fields["k"] % 4]
        if unaligned:
            width = program.nodes[unaligned[0]].fields["k"]
            raise ValueError(f"node {unaligned[0]} is a batched GEMV of width {width}: the kernel copies x's rows "
                             "16 bytes at a time, so a batched GEMV's width must be a multiple of 4")
        if share is not None:
            _check_shareable(program, share.program)
            dev, ctas = share.device, ctas or share.ctas
        self.program, self.device = program, dev
        self.ctas = ctas or torch.cuda.get_device_properties(dev).multi_processor_count
        self.built = program.build(self.ctas, check=check, cache=build_cache)
        self.reset_every = reset_interval(self.built.counter_sizes)
        self.words = torch.from_numpy(self.built.words).to(dev)
        self.table = torch.from_numpy(self.built.table).to(dev)
        self.tp_group, self.broken = tp_group, None
        self.arena = program.arena(dev) if share is None else share.arena
        if tp_group is not None and share is None:
            self.arena, self._arena_ptrs = _symmetric(self.arena, tp_group)
        elif tp_group is not None:
            self._arena_ptrs = share._arena_ptrs
        self.ints = program.int_arena(dev) if share is None else share.ints
        self.kv = program.kv if program.kv is not None else torch.zeros(8, dtype=torch.bfloat16, device=dev)
        self.emb = program.emb if program.emb is not None else torch.zeros(8, dtype=torch.bfloat16, device=dev)
        if share is not None:
            self.emb = share.emb
        elif self.emb.device != dev:
            self.emb = self.emb.to(dev)
        if self.kv.device != dev:
            raise ValueError(f"the program's KV cache is on {self.kv.device}, the executor on {dev}")
        self.counters = torch.zeros(max(1, self.built.counters), dtype=torch.int32, device=dev)
        self.err = torch.zeros(4, dtype=torch.int32, device=dev)
        self.peers = self.err                       # a one-rank kernel never reads it
        if tp_group is not None:                    # every rank's arena, then every rank's counters
            self.counters, counter_ptrs = _symmetric(self.counters, tp_group)
            self.peers = torch.tensor(self._arena_ptrs + counter_ptrs, dtype=torch.int64, device=dev)
        # with StreamConfig.trace: int64 words [instruction, kinds.TRACE_STAMPS]
        self.trace = torch.zeros((self.built.instruction_count if program.config.trace else 1, len(TRACE_STAMPS)),
                                 dtype=torch.int64, device=dev)
        cfg = program.config
        pools = [p if p.device == dev else p.to(dev) for p in program.pools] if share is None else share._pools
        self._pools = pools                         # the descriptors point into these
        # what the four weight descriptors and the cache's cover (the first pool stands in for
        # missing ones): the cache as [layers * 2 * blocks * block_size, kv_heads * head_dim] rows,
        # a box kv_box tokens of one KV head (the loader streams a context chunk as boxes of it)
        self._desc_tensors = (pools + pools[:1] * 4)[:4]
        self._kv_rows = pools[0]
        kv_box = list(cfg.weight_box)
        if program.kv is not None and cfg.head_dim:
            layers, _, blocks, bs, kvh, hd = self.kv.shape
            self._kv_rows, kv_box = self.kv.view(-1, kvh * hd), [cfg.kv_box(bs), cfg.kv_width]
        self.prebuilt = None
        if prebuilt is not None:
            from warploop.driver.select import get_driver
            from warploop.runtime.stream.prebuilt import PrebuiltError, PrebuiltKernel, TensorArg
            from warploop.target import probe_devices
            info = next((i for i in probe_devices() if i.target.backend == "cuda" and i.index == dev.index), None)
            if info is None:
                raise RuntimeError(f"the CUDA driver sees no device {dev.index} (is cuda-bindings installed? "
                                   "pip install 'warploop[cuda]')")
            driver = get_driver(info)
            try:
                self.prebuilt = PrebuiltKernel.load(prebuilt, cfg, driver)
            except PrebuiltError as e:
                raise ValueError(f"no prebuilt kernel for this program: {e}; leave prebuilt out to compile it") from e
            self._targs = ([TensorArg(t, tuple(cfg.weight_box)) for t in self._desc_tensors]
                           + [TensorArg(self._kv_rows, tuple(kv_box))])
        else:
            from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
            box, layout = list(cfg.weight_box), smem_layout(bool(cfg.batch_rows))
            self.descs = [TensorDescriptor.from_tensor(p, box, layout) for p in self._desc_tensors]
            self.kv_desc = TensorDescriptor.from_tensor(self._kv_rows, kv_box, smem_layout(cfg.attn_wgmma)
                                                        if cfg.head_dim and program.kv is not None else layout)
        self.epoch = 0

    def launch(self, steps: int = 1) -> None:
        """Queue `steps` runs of the program in one launch (a decode loop's steps: each run waits
        for the one before where the program says so) on the current stream; no wait."""
        if not 1 <= steps <= self.reset_every:
            raise ValueError(f"steps must be 1 to {self.reset_every}, not {steps}")
        if steps > 1 and self.program.loop is None:
            raise ValueError("a launch of several steps needs a decode loop (StreamProgram.decode_loop): "
                             "without one, nothing orders a step after the one before")
        if self.prebuilt is None:
            from warploop.runtime.stream.kernel import CW, stream_kernel
        if self.broken:
            raise StreamError(self.broken)
        if self.epoch + steps > self.reset_every:
            self._reset_counters()
        if self.prebuilt is not None:
            import torch
            self.prebuilt.launch(self.ctas, torch.cuda.current_stream(self.device).cuda_stream, self._targs,
                                 [self.words, self.table, self.arena, self.ints, self.kv, self.emb, self.counters,
                                  self.err, self.epoch, steps, self.trace, self.peers])
            self.epoch += steps
            return
        stream_kernel[(self.ctas,)](*self.descs, self.kv_desc, self.words, self.table, self.arena, self.ints, self.kv,
                                    self.emb, self.counters, self.err, self.epoch, steps, self.trace, self.peers,
                                    **self.program.config.constexprs(), num_warps=CW.value)
        self.epoch += steps

    def _reset_counters(self) -> None:
        """Zero the counters (each run's needs grow with the epoch). A tensor-parallel rank's peers
        bump its meet counters, so the ranks reset together: every rank's kernels done, then the
        zeroing, then no rank launches before every rank has zeroed."""
        if self.tp_group is not None:
            import torch
            import torch.distributed as dist
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.tp_group)
            self.counters.zero_()
            torch.cuda.synchronize(self.device)
            dist.barrier(group=self.tp_group)
        else:
            self.counters.zero_()
        self.epoch = 0

    def run(self, timeout: float = 60.0, steps: int = 1) -> None:
        self.launch(steps)
        self.wait(timeout)

    def idle(self) -> bool:
        """Whether every queued run has finished (never blocks)."""
        import torch
        ev = torch.cuda.Event()
        ev.record()
        return ev.query()

    def wait(self, timeout: float = 60.0) -> None:
        """Wait for the queued runs; raise if one of their waits gave up or they outlast `timeout`."""
        import torch
        ev = torch.cuda.Event()
        ev.record()
        t0 = time.monotonic()
        while not ev.query():
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the streaming kernel did not finish within {timeout} s (the GPU may be hung: "
                                   "a ring wait that never completes); restart the process")
            time.sleep(1e-4)
        err = self.err.tolist()
        if err[0] and self.tp_group is not None:
            # the peers' kernels met this one's counters part-way: no rank can start afresh alone
            self.broken = (f"CTA {err[2]} instruction {err[3]}: the wait on counter {err[1]} gave up after "
                           f"{self.program.config.spin} polls in a tensor-parallel rank, whose peers' counters are "
                           "now out of step: restart the ranks")
            raise StreamError(self.broken)
        if err[0]:
            # the runs after a wait gave up left counters (and merge tickets) part-way: start afresh
            self.err.zero_()
            self.counters.zero_()
            self.epoch = 0
            raise StreamError(f"CTA {err[2]} instruction {err[3]}: the wait on counter {err[1]} gave up after "
                              f"{self.program.config.spin} polls (a producer never published; the run's outputs "
                              "are not valid)")
