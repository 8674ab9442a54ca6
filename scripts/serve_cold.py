"""The cold start of `warploop serve` (issue 35's goal: the first request's first token within 10 s of
the command, with an empty Triton cache and no kernel compiled). For each model shape, a checkpoint
with random bf16 weights is written first (scripts/checkpoint.py; not timed), then

    python -m warploop.cli serve --model DIR --port 0 ...

starts with empty TRITON_CACHE_DIR and WARPLOOP_CACHE_DIR. It is timed from its start to the line
saying it serves (ready_s) and to the answer of a one-token /v1/completions request sent then
(first_token_s); a streamed 16-token request follows (a decode loop runs it). A compile, a failure
or a warning in the server's output marks the start failed. --block-triton starts the server in a
process where importing Triton fails (after torch's own CUDA start, which imports it), so a compile
anywhere on the path fails too.

    python scripts/serve_cold.py [--models llama-3.2-1b,qwen3-0.6b,smollm2-135m] [--block-triton]
        [--device cuda] [--dir /tmp/cold-models] [-- SERVE_ARGS...] > cold.json
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from checkpoint import write_checkpoint  # noqa: E402

from tests.no_triton import BLOCK_TRITON  # noqa: E402
from warploop.llm.shapes import CPU_MODELS, GPU_MODELS  # noqa: E402

SERVE_NO_TRITON = BLOCK_TRITON + """
from warploop.cli import main
sys.exit(main(sys.argv[1:]))
"""


def completions(url: str, t0: float, timeout_s: float) -> dict:
    """Seconds from t0 to a first completion of one token (first_token_s: random weights draw ids past
    the byte tokenizer's, so a stream's chunks carry no text to time), then a streamed one of 16
    tokens: its seconds, chunks and finish reason (a decode loop runs it)."""
    import httpx

    model = httpx.get(f"{url}/v1/models", timeout=timeout_s).json()["data"][0]["id"]
    body = {"model": model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout_s)
    r.raise_for_status()
    first = time.monotonic() - t0
    chunks, reason = 0, None
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "max_tokens": 16, "stream": True,
                                                             "ignore_eos": True}, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks += 1
                reason = json.loads(line[6:])["choices"][0].get("finish_reason") or reason
    return {"first_token_s": round(first, 2), "then_16_tokens_s": round(time.monotonic() - t0 - first, 3),
            "chunks": chunks, "finish_reason": reason}


def cold_start(model_dir: Path, device: str, block: bool, extra: list[str], timeout_s: float,
               warploop_cache: str | None = None) -> dict:
    with tempfile.TemporaryDirectory() as triton, tempfile.TemporaryDirectory() as empty:
        cache = warploop_cache or empty
        env = dict(os.environ, TRITON_CACHE_DIR=triton, WARPLOOP_CACHE_DIR=cache, WARPLOOP_DEVICE=device,
                   PYTHONUNBUFFERED="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.pop("CUDA_MODULE_LOADING", None)        # a user's start: CUDA's default, lazy module loading
        argv = ["serve", "--model", str(model_dir), "--port", "0", *extra]
        cmd = [sys.executable, "-c", SERVE_NO_TRITON, *argv] if block else [sys.executable, "-m", "warploop.cli", *argv]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
        log: list[str] = []
        serving = threading.Event()

        def drain() -> None:        # the server's output, all of it, also after it serves
            for line in proc.stdout:
                log.append(line.rstrip())
                if re.search(r"serving .* on (http://\S+) ", line):
                    serving.set()

        threading.Thread(target=drain, daemon=True).start()
        try:
            while not serving.wait(0.05):
                if proc.poll() is not None:
                    time.sleep(0.2)
                    return {"error": "the server ended before serving", "log": log[-30:]}
                if time.monotonic() - t0 > timeout_s:
                    return {"error": f"not serving after {timeout_s} s", "log": log[-30:]}
            ready = time.monotonic() - t0
            url = next(m.group(1) for x in log if (m := re.search(r"serving .* on (http://\S+) ", x)))
            try:
                out = {"ready_s": round(ready, 2), **completions(url, t0, timeout_s)}
            except Exception as exc:    # refused, timed out, an error status: the server's words say why
                time.sleep(0.5)
                return {"error": f"{type(exc).__name__}: {exc}", "log": log[-30:]}
            time.sleep(0.5)
            # a compile, or a decode loop that failed and fell back to single steps, says so in the log
            out["noticed"] = [x for x in log if re.search(r"compil|fail|error|warn", x, re.I)]
            # where the start's seconds went (`warploop serve`'s start line: imports, load, backend, warmup)
            out["started"] = next((x for x in log if x.startswith("started")), None)
            if out["finish_reason"] != "length" or out["noticed"]:
                out["error"] = "the completion did not run clean"
            return {**out, "log": log[-10:]}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(GPU_MODELS), help=f"of {', '.join({**GPU_MODELS, **CPU_MODELS})}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "cold-models"),
                    help="where the checkpoints are written (kept: a second run reuses them)")
    ap.add_argument("--block-triton", action="store_true", help="serve in a process where importing Triton fails")
    ap.add_argument("--warploop-cache", metavar="DIR",
                    help="warploop's cache (placed stream programs) to start with and keep (default: an empty one)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a start may take before it counts failed")
    ap.add_argument("serve_args", nargs="*", help="after --: more `warploop serve` arguments")
    args = ap.parse_args()
    shapes = {**GPU_MODELS, **CPU_MODELS}
    out = {"device": args.device, "block_triton": args.block_triton, "warploop_cache": args.warploop_cache,
           "models": {}}
    for name in args.models.split(","):
        if name not in shapes:
            ap.error(f"--models: {name!r} is not one of {', '.join(shapes)}")
        path = Path(args.dir) / name
        if not (path / "config.json").exists():
            write_checkpoint(path, shapes[name][1], "cuda" if args.device == "cuda" else "cpu")
        out["models"][name] = cold_start(path, args.device, args.block_triton, args.serve_args, args.timeout,
                                           args.warploop_cache)
        print(name, {k: v for k, v in out["models"][name].items() if k != "log"}, file=sys.stderr)
    print(json.dumps(out, indent=1))
    return 0 if all("error" not in r for r in out["models"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
