"""Output tokens/s of one model served three ways, under the same load (issue 36's figure):

    one       `warploop serve` with one engine
    replicas  `warploop serve --replicas 2`: two engine processes behind one endpoint (one GPU each)
    ray       Ray Serve, two replicas of warploop's deployment (warploop/llm/ray_serve.py, one GPU each)
              behind Ray's proxy, on a local Ray cluster
    engine    the peer with no serving path: one Engine in a process of its own, the same requests given
              to add_request at once each round (the prompts encoded by its tokenizer), timed alike
    pool      the same for a ReplicaPool of two engine processes (what --replicas 2 serves)

Each system runs as a process group of its own (scripts/serve_groups.py), started, measured and
stopped in turn: wait for its `/health` to answer 200, one warm-up round, the engines' deferred
start work (`--settle-s`), then `--rounds` timed rounds. A round sends
`--concurrency` non-streaming completions at once over as many keep-alive connections (serve_rounds.Client: a few
lines of HTTP/1.1 on asyncio, as httpx's pool cost more CPU than the server; `ignore_eos`, greedy,
`--max-tokens` each, the same short prompt with the request's number in front, so no two are equal);
its tokens/s is the completion tokens the answers count (`usage.completion_tokens`) over the round's
wall time. The result is the median round, p50/p99 request latency over all timed requests, and each
system's ratio to `one`. Every engine gets the same options (ENGINE: the batch holds all 64 requests,
so `one` is not held back by its batch size). A system that fails or passes `--timeout` records its
error and the tail of its log, and the next one runs; each records how it stopped ("clean": SIGTERM to
its first process left nothing of its process group running). `--save FILE` has the JSON after each
system; a SIGTERM to this script stops the system running, records it and ends the run.

    python scripts/serve_load.py --shapes llama-3.1-8b --device cuda > serve-load.json    # two GPUs
    python scripts/serve_load.py --model tiny --device cpu --concurrency 8 --max-tokens 8  # smoke test

`--shapes` writes a random-weight checkpoint of bench_tp.py's shapes to /tmp/<shapes>-random if absent.
`--profile DIR` also records where each system's processes spend the timed rounds: a py-spy (`--py-spy`,
default the one on PATH) on each Python process of its group, from the end of the warm-up for the
rounds, into DIR/serve-NAME-PID.txt (collapsed stacks, the process and the thread's name first; the
rounds' figures are then marked `profiled`: the sampling costs the servers time).
The `ray` system needs ray[serve] importable (on the GPU machine: scripts/ray_install.sh).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from serve_groups import STOP_GRACE_S, free_port, log_tail, start_profile, stop_group, wait_ready  # noqa: E402
from serve_rounds import Client, load_round, per_round, prompt_text, scrape_counts, settle, summary  # noqa: E402

SYSTEMS = ("one", "replicas", "ray", "engine", "pool")
IN_PROCESS = ("engine", "pool")         # the same engines and rounds with no HTTP (drive_engines)
REPLICAS = 2
# the same on every system and every engine: each engine may batch all the concurrent requests
ENGINE = {"max_num_seqs": 64, "max_model_len": 1024, "enable_prefix_caching": False}
RAY_SERVER = """import json, sys
sys.path.insert(0, {scripts!r})
from serve_load import serve_ray
serve_ray(json.loads(sys.argv[1]))
"""


ENGINE_DRIVER = """import json, sys
sys.path.insert(0, {scripts!r})
from serve_load import drive_engines
drive_engines(json.loads(sys.argv[1]))
"""


def drive_engines(spec: dict) -> None:
    """The `engine` and `pool` systems' process: spec["replicas"] engines (0: one Engine, else a
    ReplicaPool) run the warm-up and timed rounds measure() sends over HTTP, each round's requests
    handed to add_request at once; prints measure()'s figures as JSON."""
    import threading

    from warploop.llm.engine import Engine
    from warploop.llm.params import SamplingParams
    from warploop.llm.replicas import ReplicaPool

    options = {**spec["options"], "progress": False}
    engines = (ReplicaPool(spec["model"], spec["replicas"], **options) if spec["replicas"]
               else Engine.from_model(spec["model"], **options))
    with engines:
        text = prompt_text()
        prompts = [engines.tokenizer.encode(f"{i} {text}") for i in range(spec["concurrency"])]
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0, ignore_eos=True)

        def one_round() -> dict:
            done, lock = threading.Semaphore(0), threading.Lock()
            finished: list = []

            def on_event(t0: float, event) -> None:
                if event.finish_reason is not None:
                    with lock:
                        finished.append((time.perf_counter() - t0, event.completion_tokens, event.error))
                    done.release()
            t0 = time.perf_counter()
            for ids in prompts:
                engines.add_request(ids, params, lambda ev, t0=t0: on_event(t0, ev))
            for _ in prompts:
                if not done.acquire(timeout=spec["timeout"]):
                    raise TimeoutError("a round did not finish within --timeout")
            wall = time.perf_counter() - t0
            if errors := [e for _, _, e in finished if e]:
                raise RuntimeError(f"{len(errors)} request(s) failed: {errors[0]}")
            tokens = sum(n for _, n, _ in finished)
            return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "latencies": [s for s, _, _ in finished],
                    "short": sum(n != spec["max_tokens"] for _, n, _ in finished)}

        one_round()                                                        # warm-up
        t0 = time.monotonic()
        while engines.stats().get("deferred_pending", 0) and time.monotonic() - t0 < spec["settle_s"]:
            time.sleep(0.2)
        settled = round(time.monotonic() - t0, 1) if not engines.stats().get("deferred_pending", 0) else "timed out"
        before = engines.stats()
        timed = [one_round() for _ in range(spec["rounds"])]
        steps = per_round(before, engines.stats(), spec["rounds"])
    print(json.dumps({"settle_s": settled, **summary(timed, spec["concurrency"] * spec["max_tokens"]),
                      "per_round": steps}), flush=True)


class Terminated(Exception):
    """SIGTERM (an outer time limit): the system running is stopped and recorded, the others skipped."""


def terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)     # once: the stop that follows runs to its end
    raise Terminated("SIGTERM; the systems after this one did not run")


def engine_options(device: str) -> dict:
    return {**ENGINE, "device": device, **({"dtype": "bfloat16"} if device == "cuda" else {})}


def serve_command(model: str, options: dict, port: int, replicas: int) -> list[str]:
    """`warploop serve` with `options` (EngineConfig names) as its flags."""
    from warploop.llm.engine_config import EngineConfig

    cmd = [sys.executable, "-m", "warploop.cli", "serve", "--model", model, "--port", str(port),
           "--replicas", str(replicas), "--log-level", "warning"]
    for name, value in options.items():
        flag = EngineConfig.FLAGS[name]
        if isinstance(value, bool):      # enable_prefix_caching: its flag is --no-prefix-caching
            cmd += [] if value else [flag]
        else:
            cmd += [flag, str(value)]
    return cmd


def serve_ray(spec: dict) -> None:
    """The `ray` system's process: a local Ray cluster serving warploop's Ray Serve app on spec["port"]
    until SIGTERM, then Serve and Ray shut down."""
    import ray
    from ray import serve

    from warploop.llm.ray_serve import app_builder

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    try:
        # the object store holds nothing large here: 1 GiB, wherever /dev/shm is small
        ray.init(num_gpus=spec["gpus"], num_cpus=spec["cpus"], object_store_memory=1 << 30, include_dashboard=False)
        signal.signal(signal.SIGTERM, stop)     # ours, whatever ray.init installed
        serve.start(http_options={"host": "127.0.0.1", "port": spec["port"]})
        serve.run(app_builder(spec["args"]), route_prefix="/")
        print(f"serving on http://127.0.0.1:{spec['port']}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()


def system_command(name: str, model: str, device: str, port: int, args: argparse.Namespace | None = None) -> list[str]:
    options = engine_options(device)
    if name in IN_PROCESS:
        spec = {"model": model, "replicas": REPLICAS if name == "pool" else 0, "options": options,
                "concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
                "settle_s": args.settle_s, "timeout": args.timeout}
        return [sys.executable, "-c", ENGINE_DRIVER.format(scripts=str(ROOT / "scripts")), json.dumps(spec)]
    if name in ("one", "replicas"):
        return serve_command(model, options, port, 1 if name == "one" else REPLICAS)
    cpus = os.cpu_count() or 1
    spec = {"port": port, "gpus": REPLICAS if device == "cuda" else 0, "cpus": cpus,
            # a replica's share of the cores, as `--replicas` gives its engines on the CPU
            "args": {"model": model, "replicas": REPLICAS, "num_cpus": max(1, cpus // REPLICAS),
                     **({"num_gpus": 1} if device == "cuda" else {}), **options}}
    return [sys.executable, "-c", RAY_SERVER.format(scripts=str(ROOT / "scripts")), json.dumps(spec)]


async def measure(url: str, model: str, args: argparse.Namespace, deadline: float, on_warm=lambda: None,
                  reads: int = 1) -> dict:
    text = prompt_text()
    prompts = [f"{i} {text}" for i in range(args.concurrency)]
    client = Client(url)
    try:
        settled: list = []
        counts: list = []

        async def rounds() -> list[dict]:
            await load_round(client, model, prompts, args.max_tokens)      # warm-up
            if args.settle_s > 0:
                settled.append(await settle(client, reads, args.settle_s))
            on_warm()
            counts.append(await scrape_counts(client))
            out = [await load_round(client, model, prompts, args.max_tokens) for _ in range(args.rounds)]
            counts.append(await scrape_counts(client))
            return out
        timed = await asyncio.wait_for(rounds(), max(1.0, deadline - time.monotonic()))
    finally:
        await client.aclose()
    steps = per_round(*counts, args.rounds) if reads == 1 else {}     # Ray's scrapes reach one replica each
    return {**({"settle_s": settled[0]} if settled else {}), **summary(timed, args.concurrency * args.max_tokens),
            **({"per_round": steps} if steps else {})}


def run_system(name: str, args: argparse.Namespace, model: str, logs: Path) -> dict:
    deadline = time.monotonic() + args.timeout
    port = args.port or free_port()
    log_path = logs / f"serve-load-{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    t0 = time.monotonic()
    figures = logs / f"serve-load-{name}.json"         # an in-process system's output
    with open(log_path, "w") as log, open(figures, "w") as out:
        proc = subprocess.Popen(system_command(name, model, args.device, port, args),
                                stdout=out if name in IN_PROCESS else log, stderr=log if name in IN_PROCESS else
                                subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT, start_new_session=True)
    result: dict = {}
    spy: list = []
    try:
        if name in IN_PROCESS:
            try:
                code = proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise TimeoutError(f"{name}: the rounds did not finish within the system's time limit "
                                   f"({args.timeout:g} s)") from None
            if code != 0:
                raise RuntimeError(f"{name}: the engines' process exited with code {code}")
            result.update(json.loads(figures.read_text()))
            return result
        url = f"http://127.0.0.1:{port}"
        served = wait_ready(name, proc, url, log_path, deadline)
        result["ready_s"] = round(time.monotonic() - t0, 1)
        try:
            result.update(asyncio.run(measure(url, served, args, deadline,
                                              lambda: spy.extend(start_profile(args, name, proc.pid)),
                                              reads=4 * REPLICAS if name == "ray" else 1)))
        except TimeoutError:
            raise TimeoutError(f"{name}: the rounds did not finish within the system's time limit "
                               f"({args.timeout:g} s)") from None
    except Exception as exc:
        result = {"error": f"{type(exc).__name__}: {exc}", "log": log_tail(log_path)}
    finally:
        for p in spy:
            result["profiled"] = True
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
            if p.poll() is None:
                p.kill()
        t1 = time.monotonic()
        result["stop"] = stop_group(proc)
        result["stop_s"] = round(time.monotonic() - t1, 1)
    return result


def environment(device: str) -> dict:
    from warploop.bench.common import header

    out = header("serve-load")
    for pkg in ("ray", "httpx", "fastapi", "uvicorn"):
        try:
            out["versions"][pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out["versions"][pkg] = None
    if device == "cuda":
        import torch
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    out["cpus"] = os.cpu_count()
    return out


def ratios(systems: dict) -> dict:
    """Each measured system's tokens/s over `one`'s (and `pool`'s over `engine`'s)."""
    base = systems.get("one", {}).get("tok_s")
    out = {name: round(r["tok_s"] / base, 3) for name, r in systems.items() if base and "tok_s" in r and name != "one"}
    engine, pool = (systems.get(n, {}).get("tok_s") for n in IN_PROCESS)
    if engine and pool:
        out["pool_over_engine"] = round(pool / engine, 3)       # two engines over one, with no serving path
    return out


def main() -> int:
    from bench_tp import SHAPES

    from warploop.bench.common import checkpoint as save_partial
    from warploop.bench.common import emit

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = ap.add_mutually_exclusive_group()
    source.add_argument("--model", help="'tiny' or a Hugging Face-format model directory")
    source.add_argument("--shapes", choices=tuple(SHAPES),
                        help="random weights of these shapes (bench_tp.py), written to /tmp/<shapes>-random if absent")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=f"of {', '.join(SYSTEMS)} (default all, in turn)")
    ap.add_argument("--concurrency", type=int, default=64, help="requests in flight, each on its own connection")
    ap.add_argument("--max-tokens", type=int, default=128, help="completion tokens per request (ignore_eos)")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up; the median counts")
    ap.add_argument("--timeout", type=float, default=240.0,
                    help="seconds each system gets to serve and run its rounds (its stop comes after: up to "
                         f"{STOP_GRACE_S:g} s, then 21 s for what is left)")
    ap.add_argument("--port", type=int, default=0, help="the port every system serves on (default: a free one each)")
    ap.add_argument("--settle-s", type=float, default=300.0,
                    help="after the warm-up, wait up to this long for the engines' deferred start work (the "
                         "stream backend's split levels, built while idle) so the rounds time the steady state; "
                         "0: do not wait")
    ap.add_argument("--log-dir", help="keep each system's server log here (default: a temporary folder)")
    ap.add_argument("--save", help="also write the JSON here, after each system too (marked partial until the end)")
    ap.add_argument("--profile", metavar="DIR", help="py-spy each system's processes during its timed rounds, into DIR")
    ap.add_argument("--py-spy", default=shutil.which("py-spy"), help="py-spy's binary for --profile (default: PATH's)")
    args = ap.parse_args()
    systems = args.systems.split(",")
    if unknown := set(systems) - set(SYSTEMS):
        ap.error(f"--systems: {', '.join(sorted(unknown))} not of {', '.join(SYSTEMS)}")
    if min(args.concurrency, args.max_tokens, args.rounds) < 1:
        ap.error("--concurrency, --max-tokens and --rounds must be at least 1")
    if args.profile and not (args.py_spy and os.access(args.py_spy, os.X_OK)):
        ap.error(f"--profile needs py-spy: pip install py-spy, or give --py-spy PATH (not found: {args.py_spy})")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    model = args.model or "tiny"
    if args.shapes:
        from checkpoint import write_checkpoint

        path = Path(f"/tmp/{args.shapes}-random")
        if not (path / "config.json").is_file():
            write_checkpoint(path, SHAPES[args.shapes], args.device)
            if args.device == "cuda":
                import torch
                torch.cuda.empty_cache()        # the engines size their KV cache from the memory left free
        model = str(path)
    out = {**environment(args.device), "command": " ".join([Path(sys.executable).name, *sys.argv]),
           "model": f"{args.shapes} shapes, random weights" if args.shapes else model,
           "engine": engine_options(args.device), "replicas": REPLICAS,
           "workload": {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "rounds": args.rounds,
                        "prompt": f"<i> {prompt_text()}", "ignore_eos": True, "temperature": 0},
           "systems": {}}
    signal.signal(signal.SIGTERM, terminated)
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(args.log_dir or tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for name in systems:
            out["systems"][name] = run_system(name, args, model, logs)
            print(name, {k: v for k, v in out["systems"][name].items() if k != "log"}, file=sys.stderr, flush=True)
            out["ratio"] = ratios(out["systems"])
            save_partial(out, args.save)
            if out["systems"][name].get("error", "").startswith("Terminated"):
                break
    emit(out, args.save)
    return 0 if all("error" not in r for r in out["systems"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
