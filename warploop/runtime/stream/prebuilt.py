"""Streaming kernels compiled ahead of time and launched through the CUDA driver, with no Triton.

A build machine (Triton, no GPU) compiles each StreamConfig once per GPU arch and writes the cubin
beside a manifest entry that says everything a launch needs: the entry point, the threads and
shared memory, and the kernel's parameters as Triton lowered them (a tensor descriptor becomes a
128-byte CUtensorMap passed by value, then its shape as i32s and its strides as i64s; pointers and
scalars one each; two scratch pointers last). A server then loads the cubin and encodes the tensor
maps itself (cuTensorMapEncodeTiled), as Triton's launcher would, so starting needs no compiler.

    write_variant(config, folder, arch=90)                  # build machine: needs Triton
    kernel = PrebuiltKernel.load(folder, config, driver)    # no Triton import; None if not prebuilt
    kernel.launch(ctas, stream, [TensorArg(tensor, box), ...], [instr, table, ...])

A manifest records the hash of the kernel's sources (SOURCES) it was built from; a variant built
from other sources is never launched. The package ships a folder of variants (SHIPPED, written by
`scripts/stream_prebuild.py --shipped`), which a test keeps current.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

MANIFEST = "stream-kernels.json"
SHIPPED = Path(__file__).with_name("shipped")            # the variants the package ships
# the modules whose code the kernel is compiled from (its constexprs are in each variant's key)
SOURCES = ("kernel.py", "loader.py", "attention.py", "shares.py", "kv_rows.py", "gemv_rows.py", "small.py", "sync.py",
           "kinds.py", "compiled.py", "allreduce.py", "sampling.py", "philox.py")
SLOT = {"tmap": 128, "i32": 4, "i64": 8, "ptr": 8}       # bytes a parameter takes
ALIGN = {"tmap": 64, "i32": 4, "i64": 8, "ptr": 8}
PTX_TYPE = {"tmap": ".b8", "i32": ".u32", "i64": ".u64", "ptr": ".u64"}
# Triton's device-side TMA element types differ from the driver's enum in three places
TMA_DTYPE_DEVICE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}
L2_PROMOTION_128B = 2                                    # CU_TENSOR_MAP_L2_PROMOTION_L2_128B, as Triton sets it


class PrebuiltError(RuntimeError):
    pass


def source_hash() -> str:
    """The SHA-256 of the kernel's source files (SOURCES, each name then its bytes)."""
    h = hashlib.sha256()
    here = Path(__file__).parent
    for name in SOURCES:
        h.update(name.encode() + b"\0" + (here / name).read_bytes() + b"\0")
    return h.hexdigest()


def read_manifest(folder: str | Path) -> dict | None:
    """A folder's manifest ({"sources": hash, "kernels": {key: entry}}), or None without one."""
    path = Path(folder) / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PrebuiltError(f"{path}: not a readable manifest ({e}); rebuild it with scripts/stream_prebuild.py") from e
    if not isinstance(manifest, dict) or not isinstance(manifest.get("kernels"), dict):
        raise PrebuiltError(f"{path}: no \"kernels\" table; rebuild it with scripts/stream_prebuild.py")
    return manifest


def find(folder: str | Path, constexprs: dict, arch: int, kv_box: int | None = None) -> tuple[dict | None, str]:
    """A folder's entry for one variant, or None and why there is none (no manifest, other
    sources, not built for this shape or GPU, or, given the KV box a launch copies
    (StreamConfig.kv_box of its cache's block size), built for another)."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None, f"{folder} holds no {MANIFEST}"
    if manifest.get("sources") != source_hash():
        return None, (f"the kernels in {folder} were built from other sources than this warploop's "
                      "(rebuild them with scripts/stream_prebuild.py)")
    entry = manifest["kernels"].get(key(constexprs, arch))
    if entry is None:
        return None, f"{folder} holds no kernel for sm_{arch} and {key(constexprs, arch).partition(':')[2]}"
    built = entry["tmaps"][-1]["block_size"][0] if constexprs.get("HD") else None
    if kv_box is not None and built is not None and built != kv_box:
        return None, (f"{folder} holds this shape's kernel for KV boxes of {built} tokens, not {kv_box} "
                      "(another block size)")
    return entry, ""


def listing(folder: str | Path = SHIPPED) -> list[dict]:
    """The variants a folder holds, for `warploop info`: target, dtype, head size, group, widest
    input, batch rows, and whether they were built from this warploop's kernel sources."""
    manifest = read_manifest(folder)
    if manifest is None:
        return []
    current = manifest.get("sources") == source_hash()
    out = []
    for k in sorted(manifest["kernels"]):
        arch, _, rest = k.partition(":")
        c = dict(item.split("=", 1) for item in rest.split(","))
        out.append({"kind": "stream", "target": f"cuda:{arch.removeprefix('sm')}", "dtype": "bf16",
                    "head_dim": int(c["HD"]), "attn_group": int(c["GP"]), "kmax": int(c["KMAX"]),
                    "batch_rows": int(c["NB"]), "current": current})
    return out


def key(constexprs: dict, arch: int) -> str:
    """The manifest's name for one compiled variant: the arch and every constexpr, sorted."""
    return f"sm{arch}:" + ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in sorted(constexprs.items()))


def expand(signature: dict, constexprs: set, tmaps: list) -> list[str]:
    """The kernel's parameters in order, as Triton lowers a signature with TMA descriptors (see the
    module docstring). `tmaps`: the compiled kernel's tensordesc_meta, one entry a descriptor."""
    out, t = [], 0
    for name, ty in signature.items():
        if name in constexprs or ty == "constexpr":
            continue
        if ty.startswith("tensordesc"):
            if t >= len(tmaps) or tmaps[t] is None:
                raise PrebuiltError(f"descriptor {name}: the kernel does not take it as a CUtensorMap")
            rank = re.match(r"tensordesc<[^[>]*\[([^]]*)\]", ty).group(1).count(",") + 1
            out += ["tmap"] + ["i32"] * rank + ["i64"] * rank
            t += 1
        elif ty.startswith("*"):
            out.append("ptr")
        elif ty in ("i32", "u32", "i1"):
            out.append("i32")
        elif ty in ("i64", "u64"):
            out.append("i64")
        else:
            raise PrebuiltError(f"parameter {name}: type {ty} is not one a prebuilt kernel passes")
    return out + ["ptr", "ptr"]                         # global and profile scratch


def ptx_params(ptx: str, entry: str) -> list[str]:
    """The .param types of `entry` in the PTX, as expand() names them (for the build-time check)."""
    head = ptx[ptx.index(f".entry {entry}("):]
    head = head[:head.index(")")]
    out = []
    for decl in re.findall(r"\.param\s+([^\n,]+)", head):
        if "[128]" in decl:
            out.append("tmap")
        elif ".u32" in decl or ".b32" in decl or ".s32" in decl:
            out.append("i32")
        else:
            out.append("i64" if ".ptr" not in decl else "ptr")
    return out


def describe(ck, arch: int) -> dict:
    """A compiled stream kernel's manifest entry (no cubin): checked against its own PTX."""
    md = ck.metadata
    tmaps = list(getattr(md, "tensordesc_meta", None) or [])
    signature = dict(ck.src.signature)
    params = expand(signature, set(ck.src.constants) if hasattr(ck.src, "constants") else set(), tmaps)
    found = ptx_params(ck.asm["ptx"], md.name)
    # the PTX cannot tell an i64 from a pointer: compare with pointers as i64s
    if [p.replace("ptr", "i64") for p in params] != [p.replace("ptr", "i64") for p in found]:
        raise PrebuiltError(f"the parameters worked out from the signature ({params}) are not the PTX's ({found}): "
                            "this Triton lowers descriptors another way")
    if md.global_scratch_size or md.profile_scratch_size:
        raise PrebuiltError("the kernel asks for scratch memory, which a prebuilt launch does not give")
    return {"arch": arch, "entry": md.name, "threads": md.num_warps * md.warp_size, "shared": md.shared,
            "params": params, "tmaps": [{k: m[k] for k in ("swizzle", "elem_size", "elem_type", "block_size")}
                                        for m in tmaps],
            "triton": getattr(md, "triton_version", None)}


def write_variant(config, folder: str | Path, arch: int = 90, block_size: int = 16) -> str:
    """Compile `config` (a StreamConfig) for sm_`arch` and a KV cache of `block_size`-token blocks
    into `folder`: its cubin and its manifest entry (the manifest is merged, other entries kept).
    Returns the entry's key."""
    from warploop.runtime.stream.compiled import compile_for
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ck = compile_for(config, arch=arch, block_size=block_size)
    entry = describe(ck, arch)
    cubin = ck.asm["cubin"]
    name = hashlib.sha256(cubin).hexdigest()[:16] + ".cubin"
    (folder / name).write_bytes(cubin)
    entry["cubin"] = name
    k = key(config.constexprs(), arch)
    path = folder / MANIFEST
    manifest = read_manifest(folder) or {"kernels": {}}
    sources = source_hash()
    if manifest.get("sources") != sources:          # variants of other sources never mix with these
        for old in manifest["kernels"].values():
            if old["cubin"] != name:
                (folder / old["cubin"]).unlink(missing_ok=True)
        manifest = {"sources": sources, "kernels": {}}
    manifest["kernels"][k] = entry
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return k


@dataclasses.dataclass(frozen=True)
class TensorArg:
    """A 2-D row-major tensor a descriptor parameter covers (anything with data_ptr(), shape and
    stride(), as a torch tensor has), and the box the caller means to copy: it must be the box the
    kernel was compiled for (its expect-tx counts and shared layouts hold it)."""
    tensor: Any
    box: tuple[int, ...]


def tmap_args(meta: dict, address: int, shape: list[int], strides: list[int]) -> dict:
    """cuTensorMapEncodeTiled's arguments for one descriptor, as Triton's fill_tma_descriptor makes
    them: dimensions innermost first, byte strides of the outer dimensions, unit element strides,
    no interleave, the kernel's swizzle, 128-byte L2 promotion, no NaN fill."""
    rank = len(shape)
    if strides[-1] != 1:
        raise PrebuiltError(f"a descriptor's tensor must be contiguous in its last dimension (strides {strides})")
    if address % 16:
        raise PrebuiltError(f"a descriptor's tensor must start 16-byte aligned (0x{address:x})")
    size = meta["elem_size"]
    return {"dtype": TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]], "rank": rank, "address": address,
            "dims": [int(d) for d in reversed(shape)],
            "strides": [int(s) * size for s in reversed(strides[:-1])],
            "box": [int(b) for b in reversed(meta["block_size"])], "element_strides": [1] * rank,
            "interleave": 0, "swizzle": meta["swizzle"], "l2": L2_PROMOTION_128B, "fill": 0}


class PrebuiltKernel:
    """One prebuilt variant, loaded on a device through warploop's CUDA driver."""

    def __init__(self, entry: dict, function: Any, driver: Any) -> None:
        self.entry, self.function, self.driver = entry, function, driver
        self.params = entry["params"]
        offsets, at = [], 0
        for p in self.params:
            at = -(-at // ALIGN[p]) * ALIGN[p]
            offsets.append(at)
            at += SLOT[p]
        self.offsets, self.size = offsets, at
        # one buffer (64 extra bytes: its start is aligned to 64 by hand) and one pointer a parameter
        self._raw = (ctypes.c_char * (at + 64))()
        self.base = -(-ctypes.addressof(self._raw) // 64) * 64
        self._slots = (ctypes.c_void_p * len(self.params))(*[self.base + o for o in offsets])
        self.api = driver.launch_api(1, False, False)
        self.n_descs = len(entry["tmaps"])
        self.n_args = len(self.params) - 2 - sum(1 + 2 * len(m["block_size"]) for m in entry["tmaps"])
        self._maps: list = []                      # the encoded maps, kept while their bytes are in use

    @classmethod
    def load(cls, folder: str | Path, config, driver) -> PrebuiltKernel:
        """The prebuilt variant of `config` for the driver's device; a PrebuiltError says why there
        is none (find())."""
        entry, why = find(folder, config.constexprs(), driver.info.target.arch)
        if entry is None:
            raise PrebuiltError(why)
        function = driver.load((Path(folder) / entry["cubin"]).read_bytes(), "cubin", entry["entry"], entry["shared"])
        return cls(entry, function, driver)

    def pack(self, descs: list, args: list) -> None:
        """Write every parameter into the buffer: each descriptor's encoded map, shape and strides,
        then `args` (pointers as ints or tensors, ints) in order, then null scratch pointers."""
        if len(descs) != self.n_descs or len(args) != self.n_args:
            raise PrebuiltError(f"the kernel takes {self.n_descs} descriptors and {self.n_args} other arguments, "
                                f"not {len(descs)} and {len(args)}")
        cu = self.driver.cu
        values, d, a = [], 0, 0
        self._maps = []
        i = 0
        while i < len(self.params):
            p = self.params[i]
            if p == "tmap":
                t = descs[d].tensor
                meta = self.entry["tmaps"][d]
                if list(descs[d].box) != list(meta["block_size"]):
                    raise PrebuiltError(f"descriptor {d}: a box of {list(descs[d].box)}, but the prebuilt kernel "
                                        f"copies {meta['block_size']} (another KV block size?)")
                shape, strides = list(t.shape), list(t.stride())
                kw = tmap_args(meta, int(t.data_ptr()), shape, strides)
                # cuda-bindings takes the counts as its own cuuint32_t / cuuint64_t, not ints
                u32, u64 = cu.cuuint32_t, cu.cuuint64_t
                err, tmap = cu.cuTensorMapEncodeTiled(
                    cu.CUtensorMapDataType(kw["dtype"]), u32(kw["rank"]), kw["address"],
                    [u64(x) for x in kw["dims"]], [u64(x) for x in kw["strides"]],
                    [u32(x) for x in kw["box"]], [u32(x) for x in kw["element_strides"]],
                    cu.CUtensorMapInterleave(kw["interleave"]),
                    cu.CUtensorMapSwizzle(kw["swizzle"]), cu.CUtensorMapL2promotion(kw["l2"]),
                    cu.CUtensorMapFloatOOBfill(kw["fill"]))
                if err != 0:
                    raise PrebuiltError(f"cuTensorMapEncodeTiled: {self.driver.error_text(err)} ({kw})")
                self._maps.append(tmap)
                values.append(("tmap", tmap))
                rank = len(shape)
                values += [("i32", int(s)) for s in shape] + [("i64", int(s)) for s in strides]
                i += 1 + 2 * rank
                d += 1
                continue
            if i >= len(self.params) - 2:              # the two scratch pointers
                values.append(("ptr", 0))
            else:
                v = args[a]
                a += 1
                values.append((p, int(v.data_ptr()) if hasattr(v, "data_ptr") else int(v)))
            i += 1
        for (p, v), want, off in zip(values, self.params, self.offsets, strict=True):
            if p != want:
                raise PrebuiltError(f"parameter at {off}: {p} given where the kernel takes {want}")
            if p == "tmap":
                ctypes.memmove(self.base + off, int(v.getPtr()), 128)
            elif p == "i32":
                ctypes.c_int32.from_address(self.base + off).value = v
            else:
                ctypes.c_int64.from_address(self.base + off).value = v

    def launch(self, ctas: int, stream: Any, descs: list, args: list) -> None:
        """Queue one launch of `ctas` CTAs on `stream` (an int handle or object with .cuda_stream)."""
        self.pack(descs, args)
        ret = self.api(self.function, ctas, 1, 1, self.entry["threads"], 1, 1, self.entry["shared"],
                       self.driver.as_stream(stream), ctypes.addressof(self._slots), 0)
        if ret[0] != 0:
            raise PrebuiltError(f"launching the prebuilt stream kernel failed: {self.driver.error_text(ret[0])}")
