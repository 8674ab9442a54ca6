"""Every WARPLOOP_* environment setting, typed and validated in one place."""
from __future__ import annotations

import dataclasses
import functools
import json
import os


def _flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={raw!r} is not a boolean; use 1 or 0")


PREBUILT_WORDS = ("auto", "off")     # WARPLOOP_STREAM_PREBUILT's values other than a folder


@dataclasses.dataclass(frozen=True)
class Config:
    device: str | None        # WARPLOOP_DEVICE: cpu | cuda | hip (None: probe)
    cache_dir: str            # WARPLOOP_CACHE_DIR: where build artifacts are cached
    jobs: int                 # WARPLOOP_JOBS: parallel compile jobs for `bundle build`
    log_level: str            # WARPLOOP_LOG: debug | info | warning | error
    debug: bool = False       # WARPLOOP_DEBUG: the CLI shows tracebacks (read by cli.py through `debug_wanted`)
    mk_plan: dict = dataclasses.field(default_factory=dict)   # WARPLOOP_MK_PLAN: megakernel options (JSON object)
    stream_rows: int = 0      # WARPLOOP_STREAM_ROWS: decode batches up to this many on the stream kernel (0: per op)
    # WARPLOOP_PREFILL_GRAPHS: per-op prefills of up to this many tokens (and 4 sequences) on a GPU replay
    # CUDA graphs, one per token bucket, each captured at its first prompt (0: off). The default, 2048, is
    # the default prefill chunk (--max-prefill-tokens): H200, 1,024 tokens, 2.5x (SmolLM2-135M) and 1.5x
    # (Llama-3.2-1B) the same kernels launched op by op (BENCHMARKS.md, Prefill)
    prefill_graphs: int = 2048
    # WARPLOOP_STREAM_PREBUILT: where the stream kernel comes from: "auto" (the package's shipped
    # kernels when they hold the model's shape, else compiled), "off" (compiled), or a folder of
    # prebuilt kernels (scripts/stream_prebuild.py)
    stream_prebuilt: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in (None, "auto", "cpu", "cuda", "hip"):
            raise ValueError(f"WARPLOOP_DEVICE={self.device!r}: use cpu, cuda or hip")
        if self.jobs < 1:
            raise ValueError(f"WARPLOOP_JOBS={self.jobs}: must be at least 1")
        if self.stream_rows != 0 and not 2 <= self.stream_rows <= 32:
            raise ValueError(f"WARPLOOP_STREAM_ROWS={self.stream_rows}: use 0 (batches of 2 or more run per op) or "
                             "2 to 32 (decode batches up to that many run on the streaming kernel)")
        if not 0 <= self.prefill_graphs <= 16384:
            raise ValueError(f"WARPLOOP_PREFILL_GRAPHS={self.prefill_graphs}: use 0 (prefill runs op by op) or up to "
                             "16384 (prefills of up to that many tokens replay CUDA graphs)")
        if self.stream_prebuilt not in PREBUILT_WORDS and not os.path.isfile(
                os.path.join(self.stream_prebuilt, "stream-kernels.json")):
            raise ValueError(f"WARPLOOP_STREAM_PREBUILT={self.stream_prebuilt}: no stream-kernels.json there; use "
                             "'auto' (the kernels the package ships, where they hold the model's shape), 'off' "
                             "(compile the kernel), or a folder scripts/stream_prebuild.py wrote")
        if not isinstance(self.mk_plan, dict):
            raise ValueError(f"WARPLOOP_MK_PLAN={self.mk_plan!r}: use a JSON object, e.g. '{{\"tile_kb\": 64}}'")


def _json(name: str):
    raw = os.environ.get(name) or "{}"
    try:
        return json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name}={raw!r} is not JSON ({e.msg}); use an object, e.g. '{{\"tile_kb\": 64}}'") from None


@functools.lru_cache(maxsize=1)
def get() -> Config:
    return Config(
        device=os.environ.get("WARPLOOP_DEVICE") or None,
        cache_dir=os.environ.get("WARPLOOP_CACHE_DIR", os.path.expanduser("~/.cache/warploop")),
        jobs=int(os.environ.get("WARPLOOP_JOBS", str(os.cpu_count() or 1))),
        log_level=os.environ.get("WARPLOOP_LOG", "warning"),
        debug=debug_wanted(),
        mk_plan=_json("WARPLOOP_MK_PLAN"),
        stream_rows=_int("WARPLOOP_STREAM_ROWS", 0),
        prefill_graphs=_int("WARPLOOP_PREFILL_GRAPHS", 2048),
        stream_prebuilt=_prebuilt(os.environ.get("WARPLOOP_STREAM_PREBUILT", "").strip()),
    )


def _prebuilt(raw: str) -> str:
    """WARPLOOP_STREAM_PREBUILT: auto or off in any case (unset: auto), else a folder as given."""
    return raw.lower() if raw.lower() in PREBUILT_WORDS else raw or "auto"


def _int(name: str, default: int) -> int:
    raw = os.environ.get(name) or str(default)
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None


def debug_wanted() -> bool:
    """WARPLOOP_DEBUG, read on its own: the CLI needs it even when another setting is invalid."""
    try:
        return _flag("WARPLOOP_DEBUG", False)
    except ValueError:
        return False


def reload() -> Config:
    """Re-read the environment (tests that set WARPLOOP_* call this)."""
    get.cache_clear()
    return get()


flag = _flag
