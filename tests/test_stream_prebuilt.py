"""Prebuilt streaming kernels (runtime/stream/prebuilt.py) without a GPU: the manifest a build writes,
the tensor maps' arguments, and the parameter buffer a launch hands the driver (through a fake one)."""
import ctypes
import json
import types

import pytest

pytest.importorskip("triton.experimental.gluon")

from warploop.runtime.stream import prebuilt as pb  # noqa: E402
from warploop.runtime.stream.compiled import StreamConfig  # noqa: E402

CFG = StreamConfig(kmax=512, head_dim=64)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prebuilt")
    return folder, pb.write_variant(CFG, folder, arch=90)


def test_a_build_writes_the_cubin_and_a_manifest_entry_checked_against_the_ptx(built):
    folder, key = built
    entry = json.loads((folder / pb.MANIFEST).read_text())["kernels"][key]
    assert (folder / entry["cubin"]).read_bytes()[:4] == b"\x7fELF"
    # five descriptors (four weight pools, the KV cache), each a map, 2 shape i32s, 2 stride i64s;
    # eight pointers, epoch and steps, the trace and peers pointers, two scratch pointers
    assert entry["params"] == (["tmap", "i32", "i32", "i64", "i64"] * 5 + ["ptr"] * 8 + ["i32", "i32"]
                               + ["ptr"] * 4)
    assert entry["threads"] % 128 == 0 and entry["shared"] > 100_000
    assert [m["block_size"] for m in entry["tmaps"]] == [list(CFG.weight_box)] * 4 + [[CFG.kv_box(16), 64]]
    assert key.startswith("sm90:") and "HD=64" in key


def test_expand_refuses_a_descriptor_the_kernel_does_not_take_as_a_tensor_map():
    sig = {"d": "tensordesc<bf16[16, 256],NVMMASharedLayout()>", "x": "*fp32", "n": "i32", "B": "constexpr"}
    assert pb.expand(sig, set(), [{"swizzle": 0}]) == ["tmap", "i32", "i32", "i64", "i64", "ptr", "i32", "ptr", "ptr"]
    with pytest.raises(pb.PrebuiltError, match="CUtensorMap"):
        pb.expand(sig, set(), [None])


def test_tensor_map_arguments_are_tritons():
    # a [rows, 2048] bf16 pool with 128-byte swizzled [16, 64] boxes (a batched kernel's weights)
    meta = {"swizzle": 3, "elem_size": 2, "elem_type": 10, "block_size": [16, 64]}
    kw = pb.tmap_args(meta, 0x7F0000000100, [3072, 2048], [2048, 1])
    assert kw == {"dtype": 9, "rank": 2, "address": 0x7F0000000100, "dims": [2048, 3072], "strides": [4096],
                  "box": [64, 16], "element_strides": [1, 1], "interleave": 0, "swizzle": 3, "l2": 2, "fill": 0}
    with pytest.raises(pb.PrebuiltError, match="16-byte"):
        pb.tmap_args(meta, 0x7F0000000108, [3072, 2048], [2048, 1])
    with pytest.raises(pb.PrebuiltError, match="contiguous"):
        pb.tmap_args(meta, 0x7F0000000100, [3072, 2048], [1, 3072])


class FakeTensor:
    def __init__(self, address, shape):
        self.address, self.shape = address, tuple(shape)

    def data_ptr(self):
        return self.address

    def stride(self):
        return (self.shape[1], 1)


class FakeCu:
    """cuda.bindings.driver's calls a prebuilt launch makes: the maps (128 bytes of the map's number
    each) and their arguments are recorded."""
    def __init__(self):
        self.encoded, self._maps = [], []
        for name in ("CUtensorMapDataType", "CUtensorMapInterleave", "CUtensorMapSwizzle",
                     "CUtensorMapL2promotion", "CUtensorMapFloatOOBfill"):
            setattr(self, name, int)

    def cuTensorMapEncodeTiled(self, *args):
        self.encoded.append(args)
        raw = (ctypes.c_char * 128)(*([len(self.encoded)] * 128))
        self._maps.append(raw)
        return 0, types.SimpleNamespace(getPtr=lambda: ctypes.addressof(raw))


class FakeDriver:
    def __init__(self):
        self.cu, self.launches, self.loaded = FakeCu(), [], []
        self.info = types.SimpleNamespace(target=types.SimpleNamespace(arch=90))

    def launch_api(self, num_ctas, cooperative, pdl):
        return lambda *a: (self.launches.append(a), (0,))[1]

    def load(self, image, fmt, entry, shared):
        self.loaded.append((fmt, entry, shared, len(image)))
        return "function"

    def as_stream(self, stream):
        return stream

    def error_text(self, code):
        return f"error {code}"


def test_a_launch_packs_every_parameter_where_the_kernel_reads_it(built):
    folder, _ = built
    driver = FakeDriver()
    k = pb.PrebuiltKernel.load(folder, CFG, driver)
    assert driver.loaded == [("cubin", "stream_kernel", k.entry["shared"], driver.loaded[0][3])]
    pools = [FakeTensor(0x10000 * (i + 1), (64, 512)) for i in range(4)]
    cache = FakeTensor(0x90000, (4096, 128))
    descs = [pb.TensorArg(p, CFG.weight_box) for p in pools] + [pb.TensorArg(cache, (CFG.kv_box(16), 64))]
    ptrs = [0x1000 * (i + 1) for i in range(8)]
    k.launch(132, 7, descs, [*ptrs, 5, 32, 0xABC000, 0xDEF000])
    (fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra), = driver.launches
    assert (fn, gx, gy, gz, bx, by, bz, shared, stream, extra) == ("function", 132, 1, 1, k.entry["threads"], 1, 1,
                                                                    k.entry["shared"], 7, 0)
    slots = (ctypes.c_void_p * len(k.params)).from_address(params)
    at = [int(s) for s in slots]
    assert at == [k.base + o for o in k.offsets]
    assert all(a % 64 == 0 for a, p in zip(at, k.params, strict=True) if p == "tmap")
    i32 = lambda j: ctypes.c_int32.from_address(at[j]).value
    i64 = lambda j: ctypes.c_int64.from_address(at[j]).value
    for d in range(5):
        assert ctypes.string_at(at[5 * d], 128) == bytes([d + 1] * 128)     # the d-th map's bytes
        t = (pools + [cache])[d]
        assert [i32(5 * d + 1), i32(5 * d + 2), i64(5 * d + 3), i64(5 * d + 4)] == [*t.shape, t.shape[1], 1]
    assert [i64(25 + j) for j in range(8)] == ptrs and [i32(33), i32(34)] == [5, 32]
    assert [i64(35), i64(36), i64(37), i64(38)] == [0xABC000, 0xDEF000, 0, 0]     # trace, peers, scratch
    # the cache's map: bf16 rows of 128, boxes of [kv_box, 64], unswizzled
    dtype, rank, address, dims, strides, box = driver.cu.encoded[4][:6]
    assert (dtype, rank, address, dims, strides, box) == (9, 2, 0x90000, [128, 4096], [256], [64, CFG.kv_box(16)])


def test_a_launch_refuses_another_box_or_argument_count(built):
    folder, _ = built
    k = pb.PrebuiltKernel.load(folder, CFG, FakeDriver())
    pools = [pb.TensorArg(FakeTensor(0x10000, (64, 512)), CFG.weight_box)] * 4
    with pytest.raises(pb.PrebuiltError, match="box"):
        k.launch(1, 0, pools + [pb.TensorArg(FakeTensor(0x90000, (64, 128)), (4, 64))], [0] * 12)
    with pytest.raises(pb.PrebuiltError, match="descriptors"):
        k.launch(1, 0, pools + [pb.TensorArg(FakeTensor(0x90000, (64, 128)), (CFG.kv_box(16), 64))], [0] * 11)


def test_a_config_with_no_prebuilt_variant_is_refused_with_the_reason(built, tmp_path):
    folder, _ = built
    with pytest.raises(pb.PrebuiltError, match="no kernel for sm_90 and .*KMAX=1024"):
        pb.PrebuiltKernel.load(folder, StreamConfig(kmax=1024, head_dim=64), FakeDriver())
    with pytest.raises(pb.PrebuiltError, match="holds no stream-kernels.json"):
        pb.PrebuiltKernel.load(tmp_path, CFG, FakeDriver())


def test_kernels_built_from_other_sources_are_never_loaded_and_a_new_build_replaces_them(built, tmp_path,
                                                                                        monkeypatch):
    import shutil
    folder = tmp_path / "copy"
    shutil.copytree(built[0], folder)
    assert pb.find(folder, CFG.constexprs(), 90)[0] is not None
    monkeypatch.setattr(pb, "source_hash", lambda: "0" * 64)        # the kernel's sources changed since
    entry, why = pb.find(folder, CFG.constexprs(), 90)
    assert entry is None and "other sources" in why
    assert pb.listing(folder)[0]["current"] is False
    with pytest.raises(pb.PrebuiltError, match="other sources"):
        pb.PrebuiltKernel.load(folder, CFG, FakeDriver())
    old = {f.name for f in folder.glob("*.cubin")}
    other = StreamConfig(kmax=1024, head_dim=64)
    pb.write_variant(other, folder, arch=90)                         # a build from the new sources
    manifest = json.loads((folder / pb.MANIFEST).read_text())
    assert manifest["sources"] == "0" * 64 and list(manifest["kernels"]) == [pb.key(other.constexprs(), 90)]
    assert {f.name for f in folder.glob("*.cubin")} == {manifest["kernels"][pb.key(other.constexprs(), 90)]["cubin"]}
    assert old and not old & {f.name for f in folder.glob("*.cubin")}


def test_a_malformed_manifest_is_refused_by_name(tmp_path):
    (tmp_path / pb.MANIFEST).write_text("{not json")
    with pytest.raises(pb.PrebuiltError, match="not a readable manifest.*stream_prebuild"):
        pb.find(tmp_path, CFG.constexprs(), 90)
    (tmp_path / pb.MANIFEST).write_text('["a list"]')
    with pytest.raises(pb.PrebuiltError, match="no \"kernels\" table"):
        pb.listing(tmp_path)


def test_listing_names_each_variant(built):
    folder, _ = built
    assert pb.listing(folder) == [{"kind": "stream", "target": "cuda:90", "dtype": "bf16", "head_dim": 64,
                                   "attn_group": 4, "kmax": 512, "batch_rows": 0, "current": True}]


def test_the_prebuilt_folder_setting_is_checked_by_name(monkeypatch, tmp_path):
    from warploop import config
    monkeypatch.setenv("WARPLOOP_STREAM_PREBUILT", str(tmp_path))
    config.get.cache_clear()
    try:
        with pytest.raises(ValueError, match="WARPLOOP_STREAM_PREBUILT=.*stream-kernels.json.*'auto'.*'off'"):
            config.get()
        for raw, word in (("auto", "auto"), ("off", "off"), (" AUTO ", "auto"), ("Off", "off"), ("", "off")):
            monkeypatch.setenv("WARPLOOP_STREAM_PREBUILT", raw)
            config.get.cache_clear()
            assert config.get().stream_prebuilt == word
        monkeypatch.setenv("WARPLOOP_STREAM_PREBUILT", str(tmp_path))
        (tmp_path / pb.MANIFEST).write_text('{"kernels": {}}')
        config.get.cache_clear()
        assert config.get().stream_prebuilt == str(tmp_path)
    finally:
        monkeypatch.delenv("WARPLOOP_STREAM_PREBUILT")
        config.get.cache_clear()
