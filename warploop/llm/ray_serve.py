"""warploop on a Ray cluster: engines as Ray Serve replicas behind one OpenAI-compatible endpoint.

Each replica holds one engine (one GPU, or one tensor-parallel group, or the CPU) and serves the
same API as `warploop serve` (server.py's app: completions and chat, streaming, /v1/models,
/health, /metrics), built on the replica itself. Ray Serve's proxy spreads requests over the
replicas, scales their number between `min_replicas` and `max_replicas` by requests in flight per
replica (`target_ongoing_requests`: a queue length), and replaces a replica that dies. A replica
whose engine fails (a device fault, a watchdog timeout: server_watchdog.py) ends its process, so
Ray starts a fresh one.

Needs the `ray` extra: `pip install "warploop[ray]"`. From Python:

    from ray import serve
    from warploop.llm.ray_serve import app_builder
    serve.run(app_builder({"model": "tiny", "device": "cpu", "replicas": 2}))

or with Ray's CLI and a config file (docs/ray.md has one):

    serve run warploop.llm.ray_serve:app_builder model=tiny replicas=2

`args` (strings, as `serve run` passes them, or their types): model (required); replicas (a fixed
count) or min_replicas / max_replicas / target_ongoing_requests (autoscaling); num_gpus and
num_cpus per replica; api_key; and any EngineConfig option (device, dtype, backend, block_size,
num_kv_blocks, max_model_len, max_num_seqs, max_batch_tokens, max_prefill_tokens,
enable_prefix_caching, tensor_parallel). They are checked on the driver, before any replica starts.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from warploop.llm.engine_config import EngineConfig

log = logging.getLogger("warploop.ray")

SERVE_ARGS = {"replicas": int, "min_replicas": int, "max_replicas": int, "target_ongoing_requests": float,
              "num_gpus": float, "num_cpus": float, "api_key": str, "name": str}


def _typed(name: str, value, kind):
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes"):
            return True
        if str(value).lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{name}={value!r}: use true or false")
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: not a {kind.__name__}") from None


def parse_args(args: dict) -> tuple[str, dict, EngineConfig]:
    """(model, Ray Serve settings, engine config) from `serve run`'s key=value args (strings) or
    typed values; every name and value checked here, on the driver."""
    args = dict(args)
    model = args.pop("model", None)
    if not model:
        raise ValueError("ray_serve needs model=... (tiny, a Hugging Face-format directory or a .gguf file)")
    engine_types = {f.name: f.type for f in dataclasses.fields(EngineConfig)}
    serve_opts, engine_opts = {}, {}
    for name, value in args.items():
        if name in SERVE_ARGS:
            serve_opts[name] = _typed(name, value, SERVE_ARGS[name])
        elif name in engine_types:
            kind = engine_types[name].replace(" | None", "")
            engine_opts[name] = None if value is None or value == "None" else \
                _typed(name, value, {"int": int, "bool": bool, "str": str}[kind])
        else:
            raise ValueError(f"ray_serve: unknown argument {name!r}; the arguments are model, "
                             f"{', '.join(SERVE_ARGS)} and EngineConfig's {', '.join(engine_types)}")
    engine_opts.setdefault("progress", False)
    config = EngineConfig(**engine_opts)
    if "replicas" in serve_opts and ({"min_replicas", "max_replicas"} & set(serve_opts)):
        raise ValueError("ray_serve: give replicas (a fixed count) or min_replicas/max_replicas (autoscaling), "
                         "not both")
    for name in ("replicas", "min_replicas", "max_replicas"):
        if name in serve_opts and serve_opts[name] < (0 if name == "min_replicas" else 1):
            raise ValueError(f"ray_serve: {name}={serve_opts[name]} is out of range")
    if serve_opts.get("min_replicas", 0) > serve_opts.get("max_replicas", 1 << 30):
        raise ValueError("ray_serve: min_replicas exceeds max_replicas")
    return model, serve_opts, config


class _Replica:
    """One engine; its routes come from the app the builder makes on the replica (serve.ingress)."""


def app_builder(args: dict):
    """A Ray Serve application serving `args["model"]` (see the module's docstring)."""
    from ray import serve

    model, opts, config = parse_args(args)
    api_key = opts.get("api_key")

    def build_app():
        # runs on each replica: its own engine, and the same app `warploop serve` runs
        from warploop.llm.engine import Engine
        from warploop.llm.server import create_app

        engine = Engine.from_model(model, config=config)

        def fatal(message: str) -> None:
            log.error("warploop replica: the engine failed (%s); ending the replica so Ray starts another",
                      message)
            os._exit(1)

        return create_app(engine, api_key=api_key, on_fatal=fatal)

    gpus = opts.get("num_gpus", 0.0 if config.device in ("cpu", None) else float(config.tensor_parallel))
    settings = {"name": opts.get("name", "warploop"), "ray_actor_options": {"num_gpus": gpus,
                                                                           "num_cpus": opts.get("num_cpus", 1.0)}}
    if {"min_replicas", "max_replicas", "target_ongoing_requests"} & set(opts):
        settings["autoscaling_config"] = {"min_replicas": opts.get("min_replicas", 1),
                                          "max_replicas": opts.get("max_replicas", max(1, opts.get("min_replicas", 1))),
                                          "target_ongoing_requests": opts.get("target_ongoing_requests", 8.0)}
    else:
        settings["num_replicas"] = opts.get("replicas", 1)
    # a replica's requests in flight: as many as its engine batches, and its queue beyond that
    settings["max_ongoing_requests"] = max(8, 4 * config.max_num_seqs)
    return serve.deployment(**settings)(serve.ingress(build_app)(_Replica)).bind()
