"""What a request asks for (SamplingParams) and what comes back (StreamEvent, Completion)."""
from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class SamplingParams:
    max_tokens: int | None = 16         # None: until the context is full
    temperature: float = 1.0            # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                      # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0     # transformers' rule: positive logits / p, negative * p
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop, self.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "must be a positive integer or None"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and self.top_k >= 0, "must be >= 0 (0 or -1 turns it off)"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or _is_int(self.seed), "must be an integer or None"),
            ("repetition_penalty", _is_real(self.repetition_penalty) and self.repetition_penalty > 0, "must be > 0"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integers"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {rule}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclasses.dataclass
class StreamEvent:
    """One generated token (the last event of a request has finish_reason set)."""

    request_id: str
    token_id: int | None                # None on an abort or error event that carries no token
    text_delta: str
    finish_reason: str | None           # "stop" | "length" | "abort" | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None            # set when the engine failed this request


@dataclasses.dataclass
class Completion:
    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str
    prompt_tokens: int
    ttft_ms: float
    ms_per_token: float
    error: str | None = None
