"""Soak `warploop serve` with mixed traffic for N minutes and check it leaks nothing.

    python scripts/soak.py --minutes 10                       # starts `warploop serve --model tiny` on the CPU
    python scripts/soak.py --minutes 10 --device cuda --backend megakernel --model DIR

Traffic (asyncio, --concurrency clients at once): completions and chats, plain and streamed; streams
cancelled mid-way; bad requests (400); bodies past --max-body-bytes (413); slow clients (a body sent
in pieces, a stream read slowly). Sampled every second: the server's RSS and open file descriptors
(/proc) and its KV blocks in use (/metrics). Afterwards, with the server idle:
- every KV block is free;
- RSS is within 10% of where it stood after the warm-up (the same traffic for --warmup seconds first:
  the allocator's caches and each batch shape's buffers fill then);
- open file descriptors are back to where they stood after the warm-up (+2);
- every good request got exactly one answer, a 200 whose body is complete, and the server counted as
  many finished requests as were sent to the engine.
Prints one JSON object; exit status 1 if a check failed. tests/test_soak.py runs 30 s of it in CI
(20 s of warm-up, 10 s of soak).
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MAX_BODY = 1 << 20         # the soaked server's --max-body-bytes: an oversized body is 2 MiB, cheap to send
RSS_TOLERANCE = 0.10
FD_SLACK = 2
REQUEST_TIMEOUT_S = 120.0
KINDS = {"complete": 3, "chat": 3, "stream": 3, "cancel": 2, "bad": 2, "oversized": 1, "slow": 1}


@contextlib.contextmanager
def serving(extra: list[str], model: str = "tiny", device: str = "cpu",
            start_timeout_s: float = 300) -> Iterator[tuple[str, int]]:
    """A `warploop serve` subprocess on a free loopback port: (base URL, pid); stopped with SIGTERM."""
    env = dict(os.environ, WARPLOOP_DEVICE=device, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "warploop.cli", "serve", "--model", model, "--port", "0",
                             "--log-level", "warning", *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env, cwd=ROOT)
    try:
        deadline, url = time.monotonic() + start_timeout_s, None
        while url is None:
            line = proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError(f"warploop serve did not start: {line}")
            match = re.search(r"serving .* on (http://\S+) ", line)
            url = match.group(1) if match else None
        yield url, proc.pid
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


@dataclasses.dataclass
class Tally:
    sent: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    answered: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    to_engine: int = 0          # requests that reached the engine: each must be counted finished once
    problems: list[str] = dataclasses.field(default_factory=list)


class Traffic:
    def __init__(self, url: str, seed: int) -> None:
        self.url, self.rng, self.tally = url, random.Random(seed), Tally()

    def _prompt(self) -> str:
        words = ["import", "def", "class", "return", "self", "for", "while", "with", "yield", "lambda"]
        return " ".join(self.rng.choice(words) for _ in range(self.rng.randint(1, 12)))

    async def one(self, client: httpx.AsyncClient, kind: str) -> None:
        self.tally.sent[kind] += 1
        try:
            ok = await asyncio.wait_for(getattr(self, f"_{kind}")(client), REQUEST_TIMEOUT_S)
        except (TimeoutError, httpx.HTTPError) as exc:
            self.tally.problems.append(f"{kind}: {exc!r}")
            return
        if ok is not True:
            self.tally.problems.append(f"{kind}: {ok}")
        else:
            self.tally.answered[kind] += 1

    async def _complete(self, client) -> bool | str:
        self.tally.to_engine += 1
        r = await client.post("/v1/completions", json={"prompt": self._prompt(), "max_tokens": self.rng.randint(1, 32),
                                                       "temperature": self.rng.choice([0, 0.8])})
        return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1 or f"{r.status_code} {r.text[:200]}"

    async def _chat(self, client) -> bool | str:
        self.tally.to_engine += 1
        r = await client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": self._prompt()}], "max_tokens": self.rng.randint(1, 32)})
        return r.status_code == 200 and r.json()["object"] == "chat.completion" or f"{r.status_code} {r.text[:200]}"

    async def _stream(self, client, read_delay_s: float = 0.0, cancel_after: int | None = None) -> bool | str:
        self.tally.to_engine += 1
        body = {"prompt": self._prompt(), "max_tokens": self.rng.randint(4, 48), "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return f"{r.status_code} {(await r.aread())[:200]!r}"
            events = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events += 1
                if line == "data: [DONE]":
                    return True
                if "error" in json.loads(line[6:]):
                    return f"the stream carried an error: {line[:200]}"
                if cancel_after is not None and events >= cancel_after:
                    return True   # leaving the block closes the connection: the server must abort the request
                if read_delay_s:
                    await asyncio.sleep(read_delay_s)
        return "the stream ended without [DONE]"

    async def _cancel(self, client) -> bool | str:
        return await self._stream(client, cancel_after=self.rng.randint(1, 3))

    async def _bad(self, client) -> bool | str:
        body = self.rng.choice([b"{", b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": "5"}',
                                b'{"prompt": "x", "n": 2}', b'{"messages": []}'])
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        return r.status_code == 400 and "error" in r.json() or f"{r.status_code} {r.text[:200]}"

    async def _oversized(self, client) -> bool | str:
        body = b'{"prompt": "' + b"x" * (2 * MAX_BODY) + b'"}'
        r = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        return r.status_code == 413 and r.json()["error"]["code"] == "body_too_large" or f"{r.status_code}"

    async def _slow(self, client) -> bool | str:
        if self.rng.random() < 0.5:
            return await self._stream(client, read_delay_s=0.2)
        self.tally.to_engine += 1
        body = json.dumps({"prompt": self._prompt(), "max_tokens": 8}).encode()

        async def trickle():
            for i in range(0, len(body), 8):
                yield body[i:i + 8]
                await asyncio.sleep(0.05)

        r = await client.post("/v1/completions", content=trickle(), headers={"content-type": "application/json"})
        return r.status_code == 200 or f"{r.status_code} {r.text[:200]}"

    async def run(self, seconds: float, concurrency: int) -> None:
        kinds, weights = list(KINDS), list(KINDS.values())
        end = time.monotonic() + seconds
        limits = httpx.Limits(max_connections=concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
            async def worker() -> None:
                while time.monotonic() < end:
                    await self.one(client, self.rng.choices(kinds, weights)[0])

            await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _sample(url: str, pid: int | None, samples: list[dict], stop: asyncio.Event) -> None:
    while not stop.is_set():
        metrics = await asyncio.to_thread(scrape, url)
        sample = {"t": time.monotonic(), "kv_blocks_used": metrics["warploop_kv_blocks_used"]}
        if pid is not None:
            sample.update(rss=rss_bytes(pid), fds=open_fds(pid))
        samples.append(sample)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


def _finished(metrics: dict[str, float]) -> float:
    return sum(v for k, v in metrics.items() if k.startswith("warploop_requests_finished_total{"))


def _wait_idle(url: str, timeout_s: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = scrape(url)
        if (m["warploop_kv_blocks_used"] == 0 and m["warploop_num_requests_running"] == 0
                and m["warploop_num_requests_waiting"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def soak(url: str, pid: int | None, seconds: float, concurrency: int = 8, seed: int = 0,
         warmup_s: float = 30.0) -> dict:
    """Warm up, then run the traffic against `url` for `seconds` (the server's `pid` for RSS and fds)
    and check the aftermath against the state after the warm-up."""
    asyncio.run(Traffic(url, seed + 1).run(warmup_s, concurrency))
    _wait_idle(url)
    before = scrape(url)
    traffic, samples = Traffic(url, seed), []
    baseline = {"rss": rss_bytes(pid), "fds": open_fds(pid)} if pid is not None else {}

    async def main() -> None:
        stop = asyncio.Event()
        sampler = asyncio.ensure_future(_sample(url, pid, samples, stop))
        await traffic.run(seconds, concurrency)
        stop.set()
        await sampler

    start = time.monotonic()
    asyncio.run(main())
    after = _wait_idle(url)
    tally, problems = traffic.tally, list(traffic.tally.problems)
    if after["warploop_kv_blocks_used"] != 0:
        problems.append(f"{after['warploop_kv_blocks_used']:g} KV blocks still used when idle")
    finished = _finished(after) - _finished(before)
    if finished != tally.to_engine:
        problems.append(f"{tally.to_engine} requests reached the engine but {finished:g} finished")
    result = {"warmup_seconds": warmup_s, "seconds": round(time.monotonic() - start, 1),
              "requests": sum(tally.sent.values()), "sent": dict(tally.sent), "answered": dict(tally.answered),
              "max_kv_blocks_used": max((s["kv_blocks_used"] for s in samples), default=0)}
    if pid is not None:
        warm = baseline
        rss_end, fds_end = rss_bytes(pid), open_fds(pid)
        result.update(rss_after_warmup_mb=round(warm["rss"] / 2**20, 1), rss_end_mb=round(rss_end / 2**20, 1),
                      rss_max_mb=round(max(s["rss"] for s in samples) / 2**20, 1),
                      fds_after_warmup=warm["fds"], fds_end=fds_end)
        if abs(rss_end - warm["rss"]) > RSS_TOLERANCE * warm["rss"]:
            problems.append(f"RSS went from {warm['rss'] / 2**20:.1f} MB after warm-up to {rss_end / 2**20:.1f} MB")
        if fds_end > warm["fds"] + FD_SLACK:
            problems.append(f"open file descriptors went from {warm['fds']} after warm-up to {fds_end}")
    result["problems"] = problems
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds of traffic before the baseline")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--url", help="a running server (no RSS or fd checks unless --pid)")
    parser.add_argument("--pid", type=int, help="the running server's process id")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "hip"))
    parser.add_argument("--backend", choices=("torch", "megakernel", "stream"))
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                        help="the served model's dtype (default: the model's own; the stream backend needs bfloat16)")
    args = parser.parse_args()
    seconds = args.minutes * 60
    if args.url:
        result = soak(args.url, args.pid, seconds, args.concurrency, args.seed, args.warmup)
    else:
        extra = ["--max-body-bytes", str(MAX_BODY)] + (["--backend", args.backend] if args.backend else []) \
            + (["--dtype", args.dtype] if args.dtype else [])
        with serving(extra, args.model, args.device) as (url, pid):
            result = soak(url, pid, seconds, args.concurrency, args.seed, args.warmup)
    print(json.dumps(result))
    return 1 if result["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
