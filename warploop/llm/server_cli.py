"""`warploop serve`: load a model and serve it over the OpenAI-compatible HTTP API.

The listening socket is bound before the model loads, so a busy port fails in a second rather than
after the load, and `--port 0` works (the chosen port is printed on the "serving" line).
"""
from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import signal
import socket
import sys
import threading

from warploop.args import port, positive_int
from warploop.llm.build import BACKEND_HELP, BACKENDS
from warploop.llm.server_limits import ServerLimits, fit_connections_to_fd_limit, guarded_protocol
from warploop.llm.server_watchdog import DEFAULT_ENGINE_TIMEOUT_S

LISTEN_BACKLOG = 2048           # uvicorn's own default backlog; it listens on the socket again with its own
ENGINE_CLOSE_TIMEOUT_S = 10.0   # after a device fault the engine's thread may be stuck in it: exit anyway


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="'tiny' (the embedded model, the default), a Hugging Face-format directory, "
                             "or a .gguf file (or a directory holding one)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: loopback only; use 0.0.0.0 to expose, with --api-key)")
    parser.add_argument("--port", type=port, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every /v1 route")
    engine = parser.add_argument_group("engine")
    engine.add_argument("--device", choices=("cpu", "cuda", "hip"), default=None,
                        help="backend (default: WARPLOOP_DEVICE, else the best device found)")
    engine.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="weight and activation dtype (default: the model config's)")
    engine.add_argument("--block-size", type=positive_int, default=16, help="tokens per KV-cache block (default 16)")
    engine.add_argument("--num-kv-blocks", type=positive_int, default=None,
                        help="KV-cache blocks in the pool (default: sized from free memory)")
    engine.add_argument("--max-model-len", type=positive_int, default=None,
                        help="cap on prompt + output tokens (default: the model's, or what the KV pool holds)")
    engine.add_argument("--max-num-seqs", type=positive_int, default=32, help="most requests in one batch (default 32)")
    engine.add_argument("--max-batch-tokens", type=positive_int, default=2048,
                        help="most tokens in one engine step, prefill included (default 2048)")
    engine.add_argument("--max-prefill-tokens", type=positive_int, default=2048,
                        help="a prompt with more uncached tokens is prefilled in chunks of this many, taking turns "
                             "with decode steps of the running requests (default 2048)")
    engine.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    engine.add_argument("--backend", choices=BACKENDS, default=None, help=BACKEND_HELP)
    engine.add_argument("--tensor-parallel", type=positive_int, default=1, metavar="N",
                        help="split the model over N GPUs (N processes on the CPU); default 1. Runs per op, or with "
                             "--backend stream decodes on each rank's streaming kernel (docs/parallel.md)")
    engine.add_argument("--replicas", type=positive_int, default=1, metavar="N",
                        help="run N engines, each in its own process on its own GPU(s), behind this endpoint; "
                             "requests go to the least busy (default 1; docs/parallel.md)")
    limits = parser.add_argument_group("limits per client")
    limits.add_argument("--max-body-bytes", type=int, default=ServerLimits.max_body_bytes,
                        help=f"largest request body; larger gets 413 (default {ServerLimits.max_body_bytes})")
    limits.add_argument("--header-timeout", type=float, default=ServerLimits.header_timeout_s,
                        help="seconds a connection gets to send its request headers, and to stay idle "
                             f"between requests (default {ServerLimits.header_timeout_s:g})")
    limits.add_argument("--body-timeout", type=float, default=ServerLimits.body_timeout_s,
                        help=f"seconds a request gets to send its body; slower gets 408 "
                             f"(default {ServerLimits.body_timeout_s:g})")
    limits.add_argument("--max-connections", type=int, default=ServerLimits.max_connections,
                        help="open connections served at once; more get 503 and are closed "
                             f"(default {ServerLimits.max_connections})")
    parser.add_argument("--engine-timeout", type=float, default=DEFAULT_ENGINE_TIMEOUT_S,
                        help="seconds the engine may produce no token while requests run; then every waiting "
                             "request gets an error and the server exits with status 1 (the device hangs) "
                             f"(default {DEFAULT_ENGINE_TIMEOUT_S:g})")
    parser.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests get to finish after SIGINT/SIGTERM (default 30)")
    parser.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info",
                        help="uvicorn log level (default info)")


def bind(host: str, port: int) -> socket.socket:
    """A TCP socket listening on host:port, or SystemExit with a message naming the fix. It listens from
    here on: a client that connects as soon as the "serving ... on URL" line appears waits in the backlog
    until uvicorn accepts, rather than being refused while the app starts."""
    if not 0 <= port <= 65535:
        raise SystemExit(f"--port {port}: must be between 0 and 65535")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise SystemExit(f"--host {host!r}: cannot resolve it ({exc})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise SystemExit(f"cannot listen on {host}:{port}: {exc.strerror}; choose another --port "
                         "(0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


def _is_loopback(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0]).is_loopback


class _Terminated(Exception):
    """SIGTERM arrived: uvicorn has drained in-flight requests and re-raises the signal afterwards."""


def _raise_terminated(signum: int, frame: object) -> None:
    # The server is stopping now: a second SIGTERM (a supervisor repeating itself) must not kill the
    # process with the engine half closed, so every later one is ignored until the process exits.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Terminated


def _engine(args: argparse.Namespace):
    """One Engine, or with --replicas N a pool of N behind the same interface; errors as one line."""
    from warploop.llm.engine import Engine
    from warploop.llm.replicas import ReplicaPool

    options = dict(device=args.device, dtype=args.dtype, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_batch_tokens=args.max_batch_tokens, max_prefill_tokens=args.max_prefill_tokens,
                   enable_prefix_caching=not args.no_prefix_caching,
                   tensor_parallel=args.tensor_parallel, backend=args.backend)
    try:
        if args.replicas != 1:
            return ReplicaPool(args.model, args.replicas, **options)
        return Engine.from_model(args.model, **options)
    except (ValueError, OSError, RuntimeError) as e:
        raise SystemExit(f"warploop serve: {e}") from None


def main(args: argparse.Namespace) -> int:
    import uvicorn

    from warploop.llm.cli import device_error
    from warploop.llm.server import create_app

    problem = device_error(args.device)
    if problem:
        print(f"warploop serve: error: {problem}", file=sys.stderr)
        return 2
    try:
        limits = ServerLimits(max_body_bytes=args.max_body_bytes, header_timeout_s=args.header_timeout,
                              body_timeout_s=args.body_timeout, max_connections=args.max_connections)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    connections, warning = fit_connections_to_fd_limit(limits.max_connections)
    if warning:
        print(warning, file=sys.stderr)
        limits = dataclasses.replace(limits, max_connections=connections)
    sock = bind(args.host, args.port)
    if not _is_loopback(sock) and args.api_key is None:
        print(f"warning: serving on {args.host}, reachable from other machines, without --api-key",
              file=sys.stderr)
    # Turn SIGTERM into an exception so the engine is closed and the exit status is 0 (a requested stop).
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    engine, server, fatal, terminated = None, None, [], False

    def on_fatal(message: str) -> None:  # the engine is stuck or its device failed: every request has its error
        print(f"warploop serve: {message}; exiting", file=sys.stderr, flush=True)
        fatal.append(message)
        if server is not None:
            server.should_exit = True

    try:
        engine = _engine(args)
        app = create_app(engine, api_key=args.api_key, limits=limits, engine_timeout_s=args.engine_timeout,
                         on_fatal=on_fatal)
        config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                                http=guarded_protocol(limits), timeout_keep_alive=min(5, limits.header_timeout_s))
        host, port = sock.getsockname()[:2]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        print(start_line(engine), flush=True)
        print(f"serving {engine.model_name!r} on {url} (OpenAI base URL: {url}/v1)", flush=True)
        server = uvicorn.Server(config)
        server.run(sockets=[sock])
    except _Terminated:
        terminated = True
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)   # stopping already: the engine closes in one piece
        if engine is not None:
            _close(engine, ENGINE_CLOSE_TIMEOUT_S if fatal else None)
        sock.close()
        if not terminated:   # after a SIGTERM the process is on its way out: later ones stay ignored
            signal.signal(signal.SIGTERM, previous)
    return 1 if fatal else 0


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            started = int(f.read().rsplit(")", 1)[1].split()[19])    # field 22, starttime, in clock ticks
        with open("/proc/uptime") as f:
            return float(f.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def start_line(engine) -> str:
    """'started in 10.20 s (imports 3.40 s, load 1.90 s, backend 3.80 s (pack 0.30 s, place 3.40 s), warmup
    1.10 s)': the seconds since the command started and the engine's parts of them (Engine.start_s; a pool of
    replicas has none of its own), what came before the engine under imports."""
    times = getattr(engine, "start_s", {})
    parts = []
    for name, seconds in times.items():
        if "." not in name:
            inner = [f"{k.split('.', 1)[1]} {v:.2f} s" for k, v in times.items() if k.startswith(name + ".")]
            parts.append(f"{name} {seconds:.2f} s" + (f" ({', '.join(inner)})" if inner else ""))
    age = process_age_s()
    if age is None or not parts:
        return ("started" if age is None else f"started in {age:.2f} s") + (f" ({', '.join(parts)})" if parts else "")
    before = age - sum(v for k, v in times.items() if "." not in k)      # Python, imports, arguments
    return f"started in {age:.2f} s ({', '.join([f'imports {before:.2f} s', *parts])})"


def _close(engine, timeout_s: float | None) -> None:
    """engine.close(), or give up on it after `timeout_s` (its daemon thread ends with the process)."""
    if timeout_s is None:
        engine.close()
        return
    closer = threading.Thread(target=engine.close, name="warploop-close", daemon=True)
    closer.start()
    closer.join(timeout_s)
    if closer.is_alive():
        print(f"warploop serve: the engine did not close within {timeout_s:g} s; exiting without it",
              file=sys.stderr, flush=True)
