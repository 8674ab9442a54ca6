"""The stream kernels the package ships prebuilt (runtime/stream/shipped): built from this tree's
kernel sources, one for every shape stream_shipped.SHIPPED_KERNELS names, and found for the models
they serve. Reads files only: no Triton, no GPU."""
import json

import pytest

from warploop.llm import stream_shipped, stream_step
from warploop.llm.config import ModelConfig
from warploop.llm.shapes import GPU_MODELS
from warploop.llm.stream_shipped import SHIPPED_ARCH, prebuilt_folder, shipped_configs
from warploop.llm.stream_step import stream_config
from warploop.runtime.stream import prebuilt as pb

REBUILD = "rebuild them: PYTHONPATH=. python scripts/stream_prebuild.py --shipped (with Triton 3.6.0)"


def test_the_shipped_kernels_are_built_from_this_trees_kernel_sources():
    manifest = pb.read_manifest(pb.SHIPPED)
    assert manifest is not None, f"no shipped stream kernels; {REBUILD}"
    assert manifest["sources"] == pb.source_hash(), f"the shipped stream kernels are stale; {REBUILD}"


def test_the_source_hash_covers_every_module_with_kernel_code():
    """A module of the stream package that holds Gluon code is one of prebuilt.SOURCES, so a change
    there makes the shipped kernels stale (a new module left out would not)."""
    from pathlib import Path
    folder = Path(pb.__file__).parent
    with_jit = {f.name for f in folder.glob("*.py") if "@gluon.jit" in f.read_text()}
    assert with_jit and with_jit <= set(pb.SOURCES), sorted(with_jit - set(pb.SOURCES))


def test_the_shipped_folder_holds_exactly_the_listed_shapes_each_a_cubin():
    manifest = json.loads((pb.SHIPPED / pb.MANIFEST).read_text())
    want = {pb.key(c.constexprs(), SHIPPED_ARCH) for c in shipped_configs()}
    assert set(manifest["kernels"]) == want, REBUILD
    cubins = {e["cubin"] for e in manifest["kernels"].values()}
    assert {f.name for f in pb.SHIPPED.iterdir()} == cubins | {pb.MANIFEST}      # nothing stale beside them
    for name in cubins:
        assert (pb.SHIPPED / name).read_bytes()[:4] == b"\x7fELF"
    for e in manifest["kernels"].values():
        assert e["arch"] == 90 and e["params"][-2:] == ["ptr", "ptr"] and len(e["tmaps"]) == 5


def test_auto_finds_a_shipped_kernel_for_the_bench_models_and_the_tiny_model():
    tiny = ModelConfig.from_dir(stream_step.__file__.rsplit("/", 1)[0] + "/tiny")
    for cfg in [m for _, m in GPU_MODELS.values()] + [tiny]:
        folder, why = prebuilt_folder("auto", stream_config(cfg), 90)
        assert folder == str(pb.SHIPPED) and why == "", (cfg, why)


def test_the_setting_picks_the_source_and_auto_says_why_it_compiles():
    cfg = stream_config(GPU_MODELS["llama-3.2-1b"][1])
    assert prebuilt_folder(None, cfg, 90) == (None, "") == prebuilt_folder("off", cfg, 90)
    assert prebuilt_folder("/some/folder", cfg, 90) == ("/some/folder", "")
    folder, why = prebuilt_folder("auto", cfg, 80)                     # an A100: none shipped
    assert folder is None and "no kernel for sm_80" in why
    folder, why = prebuilt_folder("auto", stream_config(GPU_MODELS["llama-3.2-1b"][1], batch_rows=16), 90)
    assert folder is None and "NB=16" in why
    assert prebuilt_folder("auto", cfg, 90, block_size=16)[0] == str(pb.SHIPPED)    # the engine's default
    folder, why = prebuilt_folder("auto", cfg, 90, block_size=32)    # another KV box: compiled
    assert folder is None and "KV boxes of 16 tokens, not 32" in why


def test_listing_reports_every_shipped_kernel_as_current():
    rows = pb.listing()
    assert len(rows) == len(stream_shipped.SHIPPED_KERNELS) and all(r["current"] for r in rows)
    assert {(r["kmax"], r["head_dim"], r["attn_group"]) for r in rows} == set(stream_shipped.SHIPPED_KERNELS)
    assert {r["target"] for r in rows} == {"cuda:90"} and {r["dtype"] for r in rows} == {"bf16"}


def test_auto_compiles_when_a_shipped_kernel_does_not_load_and_says_why(caplog):
    from warploop.driver.base import DriverError
    from warploop.llm.stream_shipped import first_executor
    calls = []

    def make(folder):
        calls.append(folder)
        if folder is not None:
            raise DriverError("cuModuleLoadData: CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
        return "compiled"

    assert first_executor(make, "/shipped", auto=True)[:2] == ("compiled", None) and calls == ["/shipped", None]
    assert "did not load (DriverError: cuModuleLoadData" in first_executor(make, "/shipped", auto=True)[2]
    assert "compiling the streaming kernel" in caplog.text
    with pytest.raises(DriverError):            # a folder the user named: its failure is theirs to see
        first_executor(make, "/mine", auto=False)
    assert first_executor(make, None, auto=True) == ("compiled", None, "")


def test_the_serving_path_of_a_shipped_kernel_imports_no_triton():
    """What `warploop serve --backend stream` imports before it launches a shipped kernel imports no
    Triton (a GPU machine's cold start measured it: mk/loop.py's ring words pulled Triton in)."""
    import subprocess
    import sys

    from no_triton import BLOCK_TRITON
    code = BLOCK_TRITON + """
import warploop.llm.stream_backend, warploop.llm.stream_step, warploop.llm.engine, warploop.llm.server
import warploop.runtime.stream.executor, warploop.runtime.stream.prebuilt, warploop.llm.loop_step
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_stream_backend_decodes_in_loops_with_no_triton():
    """`warploop generate --backend stream` on the CPU in a process where importing Triton fails: the
    tokens come, and from decode loops (a loop that fails to start falls back to single steps with
    a warning; the loop's planner had imported mk/loop.py, and Triton with it)."""
    import subprocess
    import sys

    from no_triton import BLOCK_TRITON
    code = BLOCK_TRITON + """
from warploop.cli import main
sys.exit(main(["generate", "--model", "tiny", "--backend", "stream", "--max-tokens", "12", "--json",
               "--prompt", "Hello there"]))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["backend"] == "stream" and len(got["token_ids"]) == 12
    assert "failed" not in out.stderr and "triton" not in out.stderr.lower(), out.stderr[-2000:]
