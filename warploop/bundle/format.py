"""The `.wlb` bundle file: a fixed header, content-addressed blobs, and a JSON manifest.

    offset 0    Header (72 bytes, little-endian; see `Header`)
    offset 128  blobs, each starting on a 16-byte boundary, each stored once (keyed by SHA-256)
    ...         manifest: UTF-8 JSON (see `Manifest`), at header.manifest_offset

The header carries the file size (truncation check) and the manifest's SHA-256; the manifest
carries the SHA-256 of every blob, checked when the blob is read. docs/bundle-format.md is the
reference for every field.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import stat
import struct

from warploop.bundle import schema
from warploop.bundle.abi import ParamLayout
from warploop.bundle.export import ExportSpec

MAGIC = b"WLBUNDLE"
FORMAT_VERSION = 1
BLOBS_START = 128
BLOB_ALIGN = 16
MAX_BUNDLE_BYTES = 8 << 30    # reading stops here: a bigger "bundle" is something else
MAX_MANIFEST_BYTES = 64 << 20


class BundleFormatError(ValueError):
    """The file is not a bundle this warploop can read: wrong magic, version, size or hash."""


@dataclasses.dataclass(frozen=True)
class Header:
    version: int
    manifest_offset: int
    manifest_size: int
    file_size: int
    manifest_sha256: bytes

    LAYOUT = struct.Struct("<8sHHIQQQ32s")  # magic, version, header size, flags, offsets, sizes, hash

    def serialize(self) -> bytes:
        return self.LAYOUT.pack(MAGIC, self.version, self.LAYOUT.size, 0, self.manifest_offset,
                                self.manifest_size, self.file_size, self.manifest_sha256)

    @classmethod
    def parse(cls, data: bytes, where: str = "bundle") -> Header:
        if len(data) < cls.LAYOUT.size or data[:8] != MAGIC:
            raise BundleFormatError(f"{where} is not a warploop bundle (no WLBUNDLE header); "
                                    f"build one with `warploop bundle build FILE.py -t TARGET -o OUT.wlb`")
        magic, version, _size, _flags, offset, size, file_size, digest = cls.LAYOUT.unpack_from(data)
        if version != FORMAT_VERSION:
            raise BundleFormatError(f"{where} has bundle format version {version}, but this warploop reads "
                                    f"version {FORMAT_VERSION}: rebuild it with this warploop's "
                                    f"`warploop bundle build`, or install the warploop that wrote it")
        return cls(version, offset, size, file_size, digest)


@dataclasses.dataclass(frozen=True)
class Variant:
    """One compiled form of one specialization for one target."""

    target: str                   # 'cuda:90', 'hip:gfx942', 'cpu'
    formats: dict[str, str]       # format -> blob SHA-256: cubin+ptx (cuda), hsaco (hip), source (cpu)
    entry: str                    # symbol in the binary; for cpu, the kernel's name in the source
    num_warps: int = 4
    num_ctas: int = 1
    warp_size: int = 32
    shared: int = 0               # dynamic shared memory per program, bytes
    global_scratch_size: int = 0  # bytes per program
    global_scratch_align: int = 1
    profile_scratch_size: int = 0
    profile_scratch_align: int = 1
    cooperative: bool = False
    pdl: bool = False
    arch: str = ""                # what the binary was built for: 'sm_90a', 'gfx942', ''
    toolchain: dict = dataclasses.field(default_factory=dict)  # cuda: triton, ptxas, ptx_isa, needs (cuda_compat.py)

    @property
    def arch_specific(self) -> bool:
        """An `sm_XXa` binary (or its PTX) runs only on exactly that architecture."""
        return self.arch.startswith("sm_") and self.arch.endswith("a")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Variant:
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Specialization:
    spec: ExportSpec
    variants: tuple[Variant, ...]

    def to_dict(self) -> dict:
        return {**self.spec.to_dict(), "variants": [v.to_dict() for v in self.variants]}

    @classmethod
    def from_dict(cls, d: dict) -> Specialization:
        d = dict(d)
        d.pop("param_layout", None)  # derived from the signature; written for readers of the file
        variants = tuple(Variant.from_dict(v) for v in d.pop("variants"))
        return cls(ExportSpec.from_dict(d), variants)


@dataclasses.dataclass(frozen=True)
class KernelEntry:
    name: str
    arg_names: tuple[str, ...]    # every parameter in order, constexprs included
    specializations: tuple[Specialization, ...]

    def to_dict(self) -> dict:
        specs = []
        for s in self.specializations:
            layout = ParamLayout.of(s.spec.params(list(self.arg_names)))
            specs.append({**s.to_dict(), "param_layout": layout.to_list()})
        return {"name": self.name, "arg_names": list(self.arg_names), "specializations": specs}

    @classmethod
    def from_dict(cls, d: dict) -> KernelEntry:
        return cls(d["name"], tuple(d["arg_names"]), tuple(Specialization.from_dict(s) for s in d["specializations"]))


@dataclasses.dataclass(frozen=True)
class Manifest:
    kernels: tuple[KernelEntry, ...]
    build: dict                   # source file name and hash, targets, the command that rebuilds it, versions
    blobs: dict[str, dict]        # SHA-256 -> {"offset", "size"}

    def to_dict(self) -> dict:
        return {"format": "warploop-bundle", "format_version": FORMAT_VERSION, "build": self.build,
                "kernels": [k.to_dict() for k in self.kernels], "blobs": self.blobs}

    @classmethod
    def from_dict(cls, d: dict) -> Manifest:
        return cls(tuple(KernelEntry.from_dict(k) for k in d["kernels"]), d["build"], d["blobs"])

    def python_kernels(self) -> list[str]:
        """Kernels with a cpu variant: Python source that loading it on the CPU executor runs."""
        return [k.name for k in self.kernels if any(v.target == "cpu" for s in k.specializations for v in s.variants)]

    @property
    def targets(self) -> list[str]:
        return list(self.build.get("targets", []))

    def rebuild_command(self, extra_target: str | None = None) -> str:
        targets = self.targets + ([extra_target] if extra_target and extra_target not in self.targets else [])
        flags = " ".join([*(f"-t {t}" for t in targets), *(f"-k {k}" for k in self.build.get("kernels", []))])
        source, output = self.build.get("source", "FILE.py"), self.build.get("output", "OUT.wlb")
        return f"warploop bundle build {source} {flags} -o {output}"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_bundle(path: str | os.PathLike, kernels: list[KernelEntry], build: dict, blobs: dict[str, bytes]) -> Manifest:
    """Write kernels and their blobs (SHA-256 -> bytes) to `path` atomically; returns the manifest."""
    table: dict[str, dict] = {}
    body = bytearray()
    for digest in sorted(blobs):
        data = blobs[digest]
        if sha256(data) != digest:
            raise ValueError(f"blob {digest[:12]} does not match its own hash")
        body += b"\0" * (-(BLOBS_START + len(body)) % BLOB_ALIGN)
        table[digest] = {"offset": BLOBS_START + len(body), "size": len(data)}
        body += data
    manifest = Manifest(tuple(kernels), build, table)
    text = json.dumps(manifest.to_dict(), indent=1, sort_keys=False).encode()
    offset = BLOBS_START + len(body)
    header = Header(FORMAT_VERSION, offset, len(text), offset + len(text), hashlib.sha256(text).digest())
    tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        head = header.serialize()
        f.write(head + b"\0" * (BLOBS_START - len(head)))
        f.write(body)
        f.write(text)
    os.replace(tmp, path)
    return manifest


class BundleHashError(BundleFormatError):
    """The file is not the one the caller trusted: its SHA-256 differs from the one given."""


def _read_bounded(path: str) -> tuple[bytes, Header]:
    """The whole file, read only if it is a regular file whose header's size matches its own."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    st = os.fstat(fd)   # a FIFO or device opened without blocking, and is refused here
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BundleFormatError(f"{path} is not a regular file (a device, FIFO or directory); "
                                f"pass the path of a .wlb file")
    with os.fdopen(fd, "rb") as f:
        if st.st_size > MAX_BUNDLE_BYTES:
            raise BundleFormatError(f"{path} is {st.st_size} bytes, over the {MAX_BUNDLE_BYTES} bytes a bundle "
                                    f"may have; it is not a bundle, or build fewer kernels into each")
        header = Header.parse(f.read(BLOBS_START), path)
        if st.st_size != header.file_size:
            raise BundleFormatError(f"{path} is truncated or padded: {st.st_size} bytes on disk, "
                                    f"{header.file_size} written; copy it again or rebuild it")
        if not BLOBS_START <= header.manifest_offset <= header.file_size - header.manifest_size \
                or header.manifest_size > MAX_MANIFEST_BYTES:
            raise BundleFormatError(f"{path} is corrupted: its header places a {header.manifest_size}-byte "
                                    f"manifest at {header.manifest_offset}; copy it again or rebuild it")
        f.seek(0)
        data = f.read(st.st_size)
    if len(data) != header.file_size:
        raise BundleFormatError(f"{path} changed while it was read; read it again once it is written")
    return data, header


def _parse_manifest(text: bytes, where: str, blobs_end: int) -> Manifest:
    """The manifest's JSON, checked field by field (schema.py) before it is turned into objects."""
    fix = "it was not written by `warploop bundle build`, or was changed after: rebuild it"
    try:
        d = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise BundleFormatError(f"{where}: its manifest is not UTF-8 (byte {e.start}); {fix}") from None
    except RecursionError:
        raise BundleFormatError(f"{where}: its manifest nests too deeply; {fix}") from None
    except ValueError as e:
        raise BundleFormatError(f"{where}: its manifest is not JSON ({e}); {fix}") from None
    try:
        schema.check_manifest(d, BLOBS_START, blobs_end)
        return Manifest.from_dict(d)
    except ValueError as e:   # SchemaError, and what ExportSpec refuses (a bad type string, num_warps 3)
        raise BundleFormatError(f"{where}: {e}; {fix}") from None


class BundleFile:
    """A bundle read into memory: header and manifest checked; blobs checked as they are read.

    `sha256`: the SHA-256 (hex) of the whole file the caller trusts; any other file is refused
    before its manifest is parsed."""

    def __init__(self, path: str | os.PathLike, sha256: str | None = None):
        self.path = where = os.fspath(path)
        self.data, header = _read_bounded(where)
        self.header = header
        if sha256 is not None:
            actual = hashlib.sha256(self.data).hexdigest()
            if actual != sha256.lower():
                raise BundleHashError(f"{where} has SHA-256 {actual}, not the trusted {sha256}: it is not the "
                                      f"bundle you trusted; fetch the right file or update the trusted hash")
        text = self.data[header.manifest_offset:header.manifest_offset + header.manifest_size]
        if hashlib.sha256(text).digest() != header.manifest_sha256:
            raise BundleFormatError(f"{where} is corrupted: its manifest does not match the hash in its header; "
                                    f"copy it again or rebuild it")
        self.manifest = _parse_manifest(text, where, header.manifest_offset)

    def blob(self, digest: str, what: str = "blob") -> bytes:
        entry = self.manifest.blobs.get(digest)
        if entry is None:
            raise BundleFormatError(f"{self.path} is corrupted: {what} refers to a blob it does not contain")
        data = self.data[entry["offset"]:entry["offset"] + entry["size"]]
        if sha256(data) != digest:
            raise BundleFormatError(f"{self.path} is corrupted: the {what} does not match its SHA-256 "
                                    f"({digest[:12]}...); copy the file again or rebuild it with "
                                    f"`{self.manifest.rebuild_command()}`")
        return data

    def verify(self) -> None:
        """Check every blob's hash (load_bundle checks only the blobs it uses)."""
        for digest in self.manifest.blobs:
            self.blob(digest)
