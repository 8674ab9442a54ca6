"""The manifest's shape, as data, checked before any of it is used.

A manifest passes the header's hash check whenever whoever wrote the file also wrote the hash, so
its content is untrusted input: every field's type, which fields exist, the identifiers that the
loader turns into attributes, the blob ranges and the digests are checked here, and anything else
is a `BundleFormatError` naming the field. Nothing below recurses deeper than the schema itself.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

_SHA256 = re.compile(r"[0-9a-f]{64}")


@dataclasses.dataclass(frozen=True)
class Record:
    """A JSON object with these fields (`open`: other fields are allowed and left unchecked)."""

    required: dict[str, Any]
    optional: dict[str, Any] = dataclasses.field(default_factory=dict)
    open: bool = False


@dataclasses.dataclass(frozen=True)
class ListOf:
    item: Any
    min_items: int = 0


@dataclasses.dataclass(frozen=True)
class MapOf:
    key: Any
    value: Any


@dataclasses.dataclass(frozen=True)
class OneOf:
    choices: tuple


@dataclasses.dataclass(frozen=True)
class Nullable:
    inner: Any


# Leaf kinds: a string names what the value must be (see _leaf).
INT, STR, BOOL, IDENT, SHA256, NUMBER, SCALAR = "int", "str", "bool", "identifier", "sha256", "number", "scalar"

NEEDS = Record({"cuda": STR, "linux_driver": STR})
TOOLCHAIN = Record({}, {"triton": Nullable(STR), "ptxas": Nullable(STR), "ptx_isa": Nullable(STR),
                        "cubin_needs": NEEDS, "ptx_needs": NEEDS})
VARIANT = Record(
    {"target": STR, "formats": MapOf(OneOf(("cubin", "ptx", "hsaco", "source")), SHA256), "entry": STR},
    {"num_warps": INT, "num_ctas": INT, "warp_size": INT, "shared": INT, "global_scratch_size": INT,
     "global_scratch_align": INT, "profile_scratch_size": INT, "profile_scratch_align": INT,
     "cooperative": BOOL, "pdl": BOOL, "arch": STR, "toolchain": TOOLCHAIN})
SPECIALIZATION = Record(
    {"signature": MapOf(IDENT, STR), "constexprs": MapOf(IDENT, SCALAR), "variants": ListOf(VARIANT, 1)},
    {"num_warps": INT, "num_stages": INT, "num_ctas": INT, "specialize": MapOf(IDENT, INT), "cooperative": BOOL,
     "pdl": BOOL, "param_layout": ListOf(Record({"name": STR, "type": STR, "offset": INT}))})
KERNEL = Record({"name": IDENT, "arg_names": ListOf(IDENT), "specializations": ListOf(SPECIALIZATION, 1)})
BUILD = Record({}, {"source": STR, "source_sha256": STR, "targets": ListOf(STR), "kernels": ListOf(STR),
                    "output": STR, "date": STR, "versions": MapOf(STR, Nullable(STR))}, open=True)
MANIFEST = Record({"format": OneOf(("warploop-bundle",)), "format_version": INT, "build": BUILD,
                   "kernels": ListOf(KERNEL), "blobs": MapOf(SHA256, Record({"offset": INT, "size": INT}))})


class SchemaError(ValueError):
    """Where in the manifest (a path like `kernels[0].name`) and what is wrong there."""


def _leaf(kind: str, value: Any) -> bool:
    if kind == INT:
        return type(value) is int
    if kind == BOOL:
        return type(value) is bool
    if kind == NUMBER:
        return type(value) in (int, float)
    if kind == SCALAR:
        return type(value) in (int, float, bool, str)
    if kind == IDENT:   # becomes a Python attribute or keyword: never anything code could hide in
        return type(value) is str and value.isidentifier() and not value.startswith("__")
    if kind == SHA256:
        return type(value) is str and _SHA256.fullmatch(value) is not None
    return type(value) is str


def _describe(schema: Any) -> str:
    if isinstance(schema, str):
        return {"sha256": "a SHA-256 in lowercase hex", "identifier": "a Python identifier"}.get(schema, f"a {schema}")
    if isinstance(schema, OneOf):
        return "one of " + ", ".join(repr(c) for c in schema.choices)
    if isinstance(schema, Nullable):
        return _describe(schema.inner) + " or null"
    return {Record: "an object", ListOf: "a list", MapOf: "an object"}[type(schema)]


def check(value: Any, schema: Any, where: str = "manifest") -> None:
    """Raise SchemaError at the first place `value` does not have the shape `schema` describes."""
    def wrong() -> SchemaError:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return SchemaError(f"{where} must be {_describe(schema)}, not {shown}")

    if isinstance(schema, Nullable):
        if value is not None:
            check(value, schema.inner, where)
    elif isinstance(schema, str):
        if not _leaf(schema, value):
            raise wrong()
    elif isinstance(schema, OneOf):
        if type(value) is not str or value not in schema.choices:
            raise wrong()
    elif isinstance(schema, ListOf):
        if type(value) is not list:
            raise wrong()
        if len(value) < schema.min_items:
            raise SchemaError(f"{where} must hold at least {schema.min_items} item(s)")
        for i, item in enumerate(value):
            check(item, schema.item, f"{where}[{i}]")
    elif isinstance(schema, MapOf):
        if type(value) is not dict:
            raise wrong()
        for key, item in value.items():
            check(key, schema.key, f"{where} key {key!r}")
            check(item, schema.value, f"{where}[{key!r}]")
    else:
        if type(value) is not dict:
            raise wrong()
        missing = [k for k in schema.required if k not in value]
        if missing:
            raise SchemaError(f"{where} lacks the field(s) {', '.join(missing)}")
        unknown = [k for k in value if k not in schema.required and k not in schema.optional]
        if unknown and not schema.open:
            raise SchemaError(f"{where} has unknown field(s) {', '.join(map(repr, unknown))} "
                              f"(a newer warploop's bundle? it should have a newer format version)")
        for key, sub in {**schema.required, **schema.optional}.items():
            if key in value:
                check(value[key], sub, f"{where}.{key}")


# The loaded bundle object's own attributes (warploop.bundle.load.Bundle): a kernel of the same name
# would hide them, so such names are refused at build and at load. A test keeps this list complete.
BUNDLE_ATTRIBUTES = frozenset({"path", "device", "manifest", "kernels", "chosen"})
_FORMATS = {"cuda": {"cubin", "ptx"}, "hip": {"hsaco"}, "cpu": {"source"}}


def reserved_name_problem(name: str) -> str | None:
    """Why `name` cannot be a bundled kernel's name, or None."""
    if name in BUNDLE_ATTRIBUTES:
        return (f"kernel name {name!r} is also an attribute of the loaded bundle "
                f"({', '.join(sorted(BUNDLE_ATTRIBUTES))}); rename the kernel")
    return None


def check_manifest(d: Any, blobs_start: int, blobs_end: int) -> None:
    """The whole manifest: its shape, then what ties fields together. Raises SchemaError."""
    from warploop.target import Target

    check(d, MANIFEST)
    for digest, blob in d["blobs"].items():
        if not blobs_start <= blob["offset"] <= blob["offset"] + blob["size"] <= blobs_end:
            raise SchemaError(f"manifest.blobs[{digest[:12]}...] lies outside the blob area "
                              f"[{blobs_start}, {blobs_end}) of the file")
    names: set[str] = set()
    for i, k in enumerate(d["kernels"]):
        where = f"manifest.kernels[{i}]"
        if k["name"] in names:
            raise SchemaError(f"{where}.name {k['name']!r} appears twice")
        names.add(k["name"])
        problem = reserved_name_problem(k["name"])
        if problem:
            raise SchemaError(f"{where}.name: {problem}")
        if len(set(k["arg_names"])) != len(k["arg_names"]):
            raise SchemaError(f"{where}.arg_names repeats a name")
        for j, s in enumerate(k["specializations"]):
            spec_where = f"{where}.specializations[{j}]"
            declared = set(s["signature"]) | set(s["constexprs"])
            if declared != set(k["arg_names"]) or set(s["signature"]) & set(s["constexprs"]):
                raise SchemaError(f"{spec_where}: signature and constexprs must name each of arg_names once")
            for m, v in enumerate(s["variants"]):
                v_where = f"{spec_where}.variants[{m}]"
                try:
                    backend = Target.parse(v["target"]).backend
                except ValueError as e:
                    raise SchemaError(f"{v_where}.target: {e}") from None
                if not set(v["formats"]) or not set(v["formats"]) <= _FORMATS[backend]:
                    raise SchemaError(f"{v_where}.formats must be among {', '.join(sorted(_FORMATS[backend]))} "
                                      f"for {v['target']}, not {', '.join(v['formats']) or 'none'}")
                for fmt, digest in v["formats"].items():
                    if digest not in d["blobs"]:
                        raise SchemaError(f"{v_where}.formats.{fmt} names a blob the file does not contain")
