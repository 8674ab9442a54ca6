"""One request as the scheduler and the block manager see it."""
from __future__ import annotations

import enum
import itertools
import time

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(self, prompt_ids: list[int], params, request_id: str | None = None) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else f"req-{self.seq_id}"
        self.token_ids: list[int] = list(prompt_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[int] = []     # prefix-cache keys of the full blocks, in order
        self.num_computed_tokens = 0        # tokens whose KV is in the cache
        self.chunk_end: int | None = None   # a chunked prefill's step runs tokens [num_computed_tokens, chunk_end)
        self.generator = None               # per-request torch.Generator when the request has a seed
        self.arrived_at = time.perf_counter()
        self.admitted_at: float | None = None   # when the scheduler first gave it blocks (its prefill began)

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_completion_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens
