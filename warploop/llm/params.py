"""What a request asks for (SamplingParams) and what comes back (StreamEvent, Completion).

SamplingParams checks every field against what the engine can represent, so a request that passes
cannot fail the batched step it shares with others (a top_k past int64, a seed past uint64, a
temperature whose logits / T overflows float32).
"""
from __future__ import annotations

import dataclasses
import math

# Below these, logits / temperature overflows float32 and top_p rounds to 0 in float32: either way
# every row turns to NaN and the draw returns token 0. A smaller temperature samples greedily; a
# smaller top_p acts as MIN_TOP_P (the most likely token survives).
MIN_TEMPERATURE = 1e-5
MIN_TOP_P = 1e-6
MAX_TOP_K = 2**31 - 1                       # the kernels index the vocabulary with int32
SEED_RANGE = (-(2**63), 2**64 - 1)          # what torch.Generator.manual_seed takes
REPETITION_PENALTY_RANGE = (1e-2, 1e2)      # beyond, a penalised logit overflows float32 with a small T
MAX_STOP_STRINGS = 16                       # each is searched for after every token
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


class SamplingParamsError(ValueError):
    """A SamplingParams field is out of range; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


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
        seed_lo, seed_hi = SEED_RANGE
        pen_lo, pen_hi = REPETITION_PENALTY_RANGE
        checks = [
            ("max_tokens", self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
             "must be a positive integer or None"),
            ("temperature", _is_real(self.temperature) and self.temperature >= 0, "must be >= 0"),
            ("top_p", _is_real(self.top_p) and 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", _is_int(self.top_k) and 0 <= self.top_k <= MAX_TOP_K,
             f"must be in [0, {MAX_TOP_K}] (0 or -1 turns it off)"),
            ("min_p", _is_real(self.min_p) and 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("seed", self.seed is None or (_is_int(self.seed) and seed_lo <= self.seed <= seed_hi),
             "must be an integer in [-2**63, 2**64 - 1] or None"),
            ("repetition_penalty", _is_real(self.repetition_penalty) and pen_lo <= self.repetition_penalty <= pen_hi,
             f"must be in [{pen_lo:g}, {pen_hi:g}]"),
            ("stop", len(self.stop) <= MAX_STOP_STRINGS, f"may hold at most {MAX_STOP_STRINGS} strings"),
            ("stop", all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in self.stop),
             f"must be non-empty strings of at most {MAX_STOP_CHARS} characters"),
            ("stop_token_ids", len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
             f"may hold at most {MAX_STOP_TOKEN_IDS} ids"),
            ("stop_token_ids", all(_is_int(t) and 0 <= t <= MAX_TOP_K for t in self.stop_token_ids),
             f"must be integers in [0, {MAX_TOP_K}]"),
        ]
        for name, ok, rule in checks:
            if not ok:
                got = getattr(self, name)
                shown = f"{len(got)} items" if isinstance(got, list) and len(got) > 4 else repr(got)[:80]
                raise SamplingParamsError(name, f"{name} {rule}, got {shown}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = 0.0
        self.top_p = max(self.top_p, MIN_TOP_P)

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
    queue_ms: float | None = None       # on a request's first token: from add_request to its admission


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
    queue_ms: float = 0.0               # TTFT's parts: waiting for admission,
    prefill_ms: float = 0.0             # then the prompt's steps to the first token;
    first_step_ms: float = 0.0          # and the first token to the second
