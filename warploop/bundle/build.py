"""Ahead-of-time compilation: every exported kernel of a file, for every target, into one bundle.

No GPU is needed: Triton compiles for `GPUTarget("cuda", 90, 32)` or `GPUTarget("hip", "gfx942", 64)`
on any machine. Compilations run in a process pool (WARPLOOP_JOBS) with a progress bar on stderr.
The cpu variant is the defining file's source text: the Triton interpreter runs it, so a CPU-only
user needs neither FILE.py nor a compiler's GPU backends.
"""
from __future__ import annotations

import concurrent.futures
import datetime
import hashlib
import importlib.metadata
import importlib.util
import multiprocessing
import os
import platform
import re
import sys
from pathlib import Path
from types import ModuleType

from warploop import config
from warploop.bundle import cuda_compat
from warploop.bundle.export import ExportSpec, exported_kernels
from warploop.bundle.format import KernelEntry, Manifest, Specialization, Variant, sha256, write_bundle
from warploop.bundle.schema import reserved_name_problem
from warploop.target import CPU, Target

BUILD_TARGETS = ("cuda:80", "cuda:90", "cuda:100", "hip:gfx90a", "hip:gfx942", "hip:gfx1100", "cpu")


class BuildError(RuntimeError):
    """A kernel failed to compile for a target; the message names both and carries Triton's error."""


class TargetError(BuildError, ValueError):
    """A target `bundle build` cannot compile for; the message lists the valid ones."""


def import_source(path: Path) -> ModuleType:
    """Import FILE.py by path (once per process), with Triton's interpreter off so kernels are JITFunctions."""
    from triton import knobs

    path = path.resolve()
    name = "warploop_src_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BuildError(f"cannot import {path}: is it a Python file?")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    sys.path.insert(0, str(path.parent))  # let FILE.py import its neighbours, as `python FILE.py` would
    try:
        with knobs.runtime.scope():
            knobs.runtime.interpret = False
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def compile_variant(kernel, spec: ExportSpec, arg_names: list[str], target: Target) -> tuple[Variant, dict[str, bytes]]:
    """Compile one specialization for one GPU target: (variant, {format: bytes})."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {n: "constexpr" if n in spec.constexprs else spec.signature[n] for n in arg_names}
    attrs = {(arg_names.index(n),): [["tt.divisibility", d]] for n, d in spec.specialize.items()}
    gpu_target = GPUTarget(target.backend, target.arch, target.warp_size)
    backend = triton.compiler.make_backend(gpu_target)
    # FP fusion (a * b + c as one FMA) spelled out: Triton 3.10 turns its default off, and a bundle's
    # numbers must not change with the Triton that built it
    options = backend.parse_options({"num_warps": spec.num_warps, "num_stages": spec.num_stages,
                                     "num_ctas": spec.num_ctas, "launch_cooperative_grid": spec.cooperative,
                                     "launch_pdl": spec.pdl, "enable_fp_fusion": True})
    compiled = triton.compile(ASTSource(kernel, signature, spec.constexprs, attrs), target=gpu_target,
                              options=options.__dict__)
    md = compiled.metadata
    if getattr(md, "tensordesc_meta", None):  # the field arrived in Triton 3.6
        raise BuildError("kernels that take tensor descriptors cannot be bundled yet; pass pointers and strides")
    toolchain = {}
    if target.backend == "cuda":
        blobs = {"cubin": compiled.asm["cubin"], "ptx": compiled.asm["ptx"].encode()}
        arch = re.search(r"^\.target\s+(\w+)", compiled.asm["ptx"], re.M).group(1)
        toolchain = cuda_compat.toolchain(_version("triton"), _ptxas_version(target.arch), compiled.asm["ptx"])
    else:
        blobs = {"hsaco": compiled.asm["hsaco"]}
        arch = str(target.arch)
    variant = Variant(
        target=str(target), formats={}, entry=md.name, num_warps=md.num_warps, num_ctas=md.num_ctas,
        warp_size=md.warp_size, shared=md.shared,
        global_scratch_size=getattr(md, "global_scratch_size", 0),
        global_scratch_align=getattr(md, "global_scratch_align", 1),
        profile_scratch_size=md.profile_scratch_size, profile_scratch_align=md.profile_scratch_align,
        cooperative=bool(md.launch_cooperative_grid), pdl=bool(getattr(md, "launch_pdl", False)), arch=arch,
        toolchain=toolchain)
    return variant, blobs


def _ptxas_version(arch: int) -> str | None:
    """The CUDA release of the ptxas Triton uses for `arch` ('12.8'), or None if this Triton hides it."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).version
    except (ImportError, AttributeError, RuntimeError, OSError):
        return None


def _compile_job(job: tuple[str, str, int, str]) -> tuple[tuple[str, int, str], dict, dict[str, bytes]]:
    path, name, index, target_text = job
    kernel, specs, arg_names = exported_kernels(vars(import_source(Path(path))))[name]
    try:
        variant, blobs = compile_variant(kernel, specs[index], arg_names, Target.parse(target_text))
    except Exception as e:  # re-raised in the parent with the kernel and target named
        raise BuildError(f"compiling {name} [{specs[index].label()}] for {target_text} failed: "
                         f"{type(e).__name__}: {e}") from None
    return (name, index, target_text), variant.to_dict(), blobs


def _run_jobs(jobs: list[tuple[str, str, int, str]], workers: int, progress: bool) -> list:
    from tqdm import tqdm

    def progress_bar():
        # A bar only on a terminal: redirected into a file or a CI log it is carriage-return noise.
        return tqdm(total=len(jobs), desc="compiling", unit="variant", file=sys.stderr,
                    disable=not (progress and sys.stderr.isatty()))

    if workers <= 1 or len(jobs) <= 1:
        with progress_bar() as bar:
            results = []
            for job in jobs:
                results.append(_compile_job(job))
                bar.update()
            return results
    # fork: workers inherit the imported FILE.py and Triton instead of importing them again. The pool
    # starts its workers as jobs are submitted, before the progress bar exists, so no thread is forked.
    context = multiprocessing.get_context("fork" if sys.platform == "linux" else "spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = [pool.submit(_compile_job, j) for j in jobs]
        with progress_bar() as bar:
            results = []
            for future in concurrent.futures.as_completed(futures):
                results.append(future.result())
                bar.update()
            return results


def _local_imports(before: set[str], directory: Path) -> list[str]:
    """Modules FILE.py pulled in from its own folder: the cpu variant does not carry them."""
    out = []
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file and Path(file).resolve().parent == directory and not name.startswith("warploop_src_"):
            out.append(name)
    return sorted(out)


def build_bundle(source: str | os.PathLike, targets: list[str], output: str | os.PathLike,
                 jobs: int | None = None, progress: bool = True, only: list[str] | None = None) -> Manifest:
    """Compile every kernel that `source` exports (or those named in `only`) for each target into `output`."""
    path = Path(source).resolve()
    if not path.is_file():
        raise BuildError(f"{source}: no such file")
    parsed = [build_target(t) for t in targets]
    if not parsed:
        raise BuildError(f"no targets given; pass -t for each, e.g. {' '.join('-t ' + t for t in BUILD_TARGETS)}")
    before = set(sys.modules)
    try:
        module = import_source(path)
    except SyntaxError as e:
        raise BuildError(f"{source}, line {e.lineno}: {e.msg}; fix the file: it must import as Python") from None
    except Exception as e:  # the user's file raised while importing: name it, not warploop's internals
        raise BuildError(f"importing {source} failed: {type(e).__name__}: {e}") from None
    kernels = exported_kernels(vars(module))
    if not kernels:
        raise BuildError(f"{source} exports no kernels: decorate Triton kernels with @warploop.export(...)")
    if only:
        unknown = [k for k in only if k not in kernels]
        if unknown:
            raise BuildError(f"{source} exports no kernel {', '.join(unknown)}; it exports {', '.join(kernels)}")
        kernels = {k: v for k, v in kernels.items() if k in only}
    for name in kernels:
        problem = reserved_name_problem(name)
        if problem:
            raise BuildError(f"{source}: {problem}")
    local = _local_imports(before, path.parent)
    if local and any(t.backend == "cpu" for t in parsed):
        print(f"warning: {path.name} imports {', '.join(local)} from its folder; the cpu variant carries only "
              f"{path.name}, so kernels that call into those modules fail on the CPU executor", file=sys.stderr)
    jobs_list = [(str(path), name, i, str(t)) for name, (_, specs, _) in kernels.items()
                 for i in range(len(specs)) for t in parsed if t.is_gpu]
    workers = min(jobs or config.get().jobs, max(1, len(jobs_list)))
    if progress and jobs_list:
        cpu = sum(len(specs) for _, specs, _ in kernels.values()) if CPU in parsed else 0
        print(f"compiling {len(jobs_list)} GPU variants with {workers} jobs"
              + (f"; {cpu} cpu variants carry the source" if cpu else ""), file=sys.stderr)
    compiled = {key: (Variant.from_dict(v), blobs) for key, v, blobs in _run_jobs(jobs_list, workers, progress)}

    source_bytes = path.read_bytes()
    all_blobs: dict[str, bytes] = {}
    entries = []
    for name, (_, specs, arg_names) in kernels.items():
        specializations = []
        for i, spec in enumerate(specs):
            variants = []
            for t in parsed:
                if t.is_gpu:
                    variant, blobs = compiled[(name, i, str(t))]
                else:
                    variant, blobs = Variant(target="cpu", formats={}, entry=name, num_warps=spec.num_warps,
                                             warp_size=1), {"source": source_bytes}
                digests = {fmt: sha256(data) for fmt, data in blobs.items()}
                all_blobs.update({sha256(data): data for data in blobs.values()})
                variants.append(Variant.from_dict({**variant.to_dict(), "formats": digests}))
            specializations.append(Specialization(spec, tuple(variants)))
        entries.append(KernelEntry(name, tuple(arg_names), tuple(specializations)))

    build = {"source": path.name, "source_sha256": sha256(source_bytes), "targets": [str(t) for t in parsed],
             "kernels": list(only or []),
             "output": Path(output).name, "date": datetime.date.today().isoformat(),
             "versions": {"warploop": _version("warploop"), "triton": _version("triton"),
                          "python": platform.python_version()}}
    return write_bundle(output, entries, build, all_blobs)


def build_target(text: str) -> Target:
    """A target `bundle build` compiles for; anything else is rejected with the list of valid ones."""
    valid = f"valid targets: {', '.join(BUILD_TARGETS)} (a cuda:86 or cuda:89 GPU runs the cuda:80 variant)"
    try:
        target = Target.parse(text)
    except ValueError:
        raise TargetError(f"cannot parse target {text!r}; {valid}") from None
    if str(target) not in BUILD_TARGETS:
        raise TargetError(f"target {text!r} is not one warploop builds for; {valid}")
    return target


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
