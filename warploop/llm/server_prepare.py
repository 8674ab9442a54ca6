"""From a request body to what the engine takes (prompt ids, SamplingParams), off the event loop.

Parsing, chat-template rendering and tokenising cost time in proportion to the body (seconds for
a few MB of text): they run on a small thread pool, so /health and every stream keep being served
meanwhile (the tokenizer is called through its GIL-releasing batch API). A text longer than the
context could hold is refused before it is tokenised.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from warploop.llm.openai_schema import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    max_tokens_for,
    parse_body,
    sampling_kwargs,
)
from warploop.llm.params import SamplingParams, SamplingParamsError

# A tokenizer's normaliser may shrink text slightly before it is split (NFKC, stripping); this margin
# keeps the characters-per-token bound from refusing a prompt that would fit.
CHARS_BOUND_MARGIN = 2


@dataclasses.dataclass
class Prepared:
    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: SamplingParams


class RequestPreparer:
    """`await preparer(raw, schema)` -> Prepared, or APIError naming the field at fault."""

    def __init__(self, engine: Any, check_model: Callable[[str | None], None], default_max_tokens: int,
                 threads: int = min(4, os.cpu_count() or 1)) -> None:
        self._engine, self._check_model, self._default = engine, check_model, default_max_tokens
        # Idle workers end with the interpreter; a busy one ends within the chat template's deadline.
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="warploop-prepare")
        tokenizer = engine.tokenizer
        self._max_chars = (CHARS_BOUND_MARGIN * engine.max_context * tokenizer.max_token_chars
                           if tokenizer is not None else None)

    async def __call__(self, raw: bytes, schema: type) -> Prepared:
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._prepare, raw, schema)

    def _prepare(self, raw: bytes, schema: type) -> Prepared:
        body = parse_body(raw, schema)
        self._check_model(body.model)
        prompt_ids = self._prompt_ids(body)
        chat = isinstance(body, ChatCompletionRequest)
        max_tokens = max_tokens_for(body, len(prompt_ids), self._engine.max_context, None if chat else self._default)
        try:
            params = SamplingParams(**sampling_kwargs(body, max_tokens))
        except SamplingParamsError as e:
            raise APIError(400, str(e), param=e.field) from None
        return Prepared(body, prompt_ids, params)

    def _prompt_ids(self, body: CompletionRequest | ChatCompletionRequest) -> list[int]:
        tokenizer = self._engine.tokenizer
        if isinstance(body, ChatCompletionRequest):
            try:
                text = tokenizer.apply_chat_template([m.as_template_input() for m in body.messages])
            except ValueError as exc:  # no chat template, or the template refused or failed
                raise APIError(400, str(exc), param="messages") from None
            return self._encode(text, "messages")
        prompt = body.single_prompt()
        return self._encode(prompt, "prompt") if isinstance(prompt, str) else list(prompt)  # the engine checks ids

    def _encode(self, text: str, param: str) -> list[int]:
        if self._max_chars is not None and len(text) > self._max_chars:
            raise APIError(400, f"the {param} is {len(text)} characters long, more than this model's context of "
                                f"{self._engine.max_context} tokens can hold; shorten it",
                           param=param, code="context_length_exceeded")
        return self._engine.tokenizer.encode(text)
