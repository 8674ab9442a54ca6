"""A round of concurrent completions and what it counts, for scripts/serve_load.py: the load's own
HTTP client (Client), a round (load_round), the wait for the engines' deferred start work (settle),
the engine's step counters (scrape_counts, per_round) and the rounds' summary (summary)."""
from __future__ import annotations

import asyncio
import json
import random
import statistics
import time


def prompt_text(words: int = 12) -> str:
    rng = random.Random(36)
    return " ".join("".join(rng.choice("etaoinshrdlucmfw") for _ in range(rng.randint(2, 7))) for _ in range(words))


class Reply:
    def __init__(self, status_code: int, content: bytes) -> None:
        self.status_code, self.content = status_code, content

    @property
    def text(self) -> str:
        return self.content.decode(errors="replace")

    def json(self):
        return json.loads(self.content)


class Client:
    """HTTP/1.1 over asyncio streams, one keep-alive connection a request in flight (a free one is
    reused, else one is opened). The load's own client must cost little next to the server: on a
    2-core machine httpx's AsyncClient spent 0.6-0.9 s of CPU on a round of 64 completions against a
    server that answered at once, and this client 0.01 s (the whole round 0.03 s)."""

    def __init__(self, url: str) -> None:
        host, _, port = url.removeprefix("http://").partition(":")
        self.host, self.port = host, int(port)
        self._free: list = []

    async def _exchange(self, method: str, path: str, body: bytes) -> Reply:
        while self._free:                   # a kept connection the server may have closed meanwhile (its
            try:                            # keep-alive timeout): nothing of the reply came, so ask again
                return await self._once(self._free.pop(), method, path, body)
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if getattr(e, "partial", b""):
                    raise
        return await self._once(await asyncio.open_connection(self.host, self.port), method, path, body)

    async def _once(self, conn: tuple, method: str, path: str, body: bytes) -> Reply:
        reader, writer = conn
        try:
            writer.write(f"{method} {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
                         f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            status = int(head[0].split()[1])
            headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in head[1:] if ":" in h)}
            if "content-length" in headers:
                content = await reader.readexactly(int(headers["content-length"]))
            elif headers.get("transfer-encoding", "").lower() == "chunked":
                parts = []
                while size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16):
                    parts.append(await reader.readexactly(size + 2))
                await reader.readuntil(b"\r\n")
                content = b"".join(p[:-2] for p in parts)
            else:                                   # the body runs to the connection's end
                content = await reader.read()
                headers["connection"] = "close"
        except BaseException:
            writer.close()
            raise
        if headers.get("connection", "").lower() == "close":
            writer.close()
        else:
            self._free.append(conn)
        return Reply(status, content)

    async def post(self, path: str, json_body: dict) -> Reply:
        return await self._exchange("POST", path, json.dumps(json_body).encode())

    async def get(self, path: str) -> Reply:
        return await self._exchange("GET", path, b"")

    async def aclose(self) -> None:
        for _, writer in self._free:
            writer.close()
        self._free.clear()


async def load_round(client, model: str, prompts: list[str], max_tokens: int) -> dict:
    async def one(prompt: str) -> tuple[float, int]:
        t = time.perf_counter()
        r = await client.post("/v1/completions", {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        return time.perf_counter() - t, r.json()["usage"]["completion_tokens"]

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    tokens = sum(n for _, n in done)
    return {"wall_s": wall, "tokens": tokens, "tok_s": tokens / wall, "latencies": [s for s, _ in done],
            "short": sum(n != max_tokens for _, n in done)}


SETTLED_GAUGE = "warploop_deferred_start_pending"
# the engine's counters a timed round is described by (engine.stats(); /metrics' warploop_<name>_total)
COUNTS = ("prefill_steps", "decode_steps", "overlapped_steps", "decode_loops", "decode_loop_tokens")


def per_round(before: dict, after: dict, rounds: int) -> dict:
    """COUNTS' change over the timed rounds, a round's on average."""
    return {k: round((after[k] - before[k]) / rounds, 1) for k in COUNTS if k in before and k in after}


async def scrape_counts(client) -> dict:
    """COUNTS from /metrics (a server that exports them; {} otherwise)."""
    r = await client.get("/metrics")
    out = {}
    for line in r.text.splitlines() if r.status_code == 200 else ():
        for k in COUNTS:
            if line.startswith(f"warploop_{k}_total "):
                out[k] = float(line.split()[-1])
    return out


async def settle(client, reads: int, limit_s: float) -> float | str:
    """Wait until the system's engines have done their deferred start work (the stream backend builds
    its split levels while idle: /metrics' SETTLED_GAUGE reads 0, `reads` times in a row, 0.2 s apart:
    Ray's proxy sends each scrape to one replica); the seconds it took, or why not ("not reported" by a
    server without the gauge, "timed out" after `limit_s`)."""
    t0, zeros = time.monotonic(), 0
    while zeros < reads:
        if time.monotonic() - t0 > limit_s:
            return "timed out"
        r = await client.get("/metrics")
        values = [line.split()[-1] for line in r.text.splitlines() if line.startswith(SETTLED_GAUGE + " ")]
        if r.status_code != 200 or not values:
            return "not reported"
        zeros = zeros + 1 if float(values[0]) == 0 else 0
        if zeros < reads:
            await asyncio.sleep(0.2)
    return round(time.monotonic() - t0, 1)


def summary(timed: list[dict], expected: int) -> dict:
    """The median round's tokens/s, every round's, and request latency p50/p99 over all of them."""
    latencies = sorted(s for r in timed for s in r["latencies"])
    median = sorted(timed, key=lambda r: r["tok_s"])[(len(timed) - 1) // 2]     # the lower of two middles
    return {"tok_s": round(median["tok_s"], 1), "round_tok_s": [round(r["tok_s"], 1) for r in timed],
            "round_wall_s": [round(r["wall_s"], 3) for r in timed], "tokens_per_round": median["tokens"],
            "expected_tokens_per_round": expected, "short_completions": sum(r["short"] for r in timed),
            "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_p99_s": round(latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 3)}
