"""Request bodies of the OpenAI-compatible API, the error body, and the mapping to SamplingParams.

Requests are validated strictly: an unknown field, a value of the wrong JSON type (no coercion of
"5" or true to 5) or a feature this server does not implement (n > 1, logprobs, penalties,
tools, ...) is a 400 that names the parameter, never silently ignored. Value ranges the engine
imposes are SamplingParams' (warploop.llm.params), reported with the same `param`.
Beyond OpenAI's fields, the vLLM-style extensions top_k, min_p, repetition_penalty, ignore_eos and
stop_token_ids are accepted.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from warploop.llm.params import (
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_K,
    REPETITION_PENALTY_RANGE,
    SEED_RANGE,
)


def only(*values: Any, why: str) -> Any:
    """A field parsed but accepted only at `values`: the published schema says so (enum), while the
    400 for any other value stays check_supported's, which names the field and the alternative."""
    return Field(default=values[0], json_schema_extra={"enum": list(values)}, description=why)


def documented(**extra: Any) -> dict[str, Any]:
    """Bounds enforced by SamplingParams (with its messages), published in the schema as well."""
    return {"json_schema_extra": extra}


class APIError(Exception):
    """A failed request, answered with `status` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = Field(default=False, description="end the stream with a chunk holding `usage` and no "
                                                           "choices")


class _SamplingFields(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    # strict: JSON types as documented; "5" or true for an integer, "yes" for a boolean, is a 400
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = Field(default=None, description="if given, the served model's id (see /v1/models)")
    max_tokens: int | None = Field(default=None, ge=1, description="most tokens to generate; prompt + max_tokens "
                                   "must fit the context (completions default 16, chat: the rest of the context)")
    temperature: float = Field(default=1.0, ge=0.0, le=2.0, description="0 is greedy")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = only(1, why="choices per request: only 1")
    stream: bool = Field(default=False, description="answer as server-sent events (text/event-stream)")
    stream_options: StreamOptions | None = Field(default=None, description="only with stream: true")
    stop: str | list[str] | None = Field(default=None, **documented(
        maxItems=MAX_STOP_STRINGS, minLength=1, maxLength=MAX_STOP_CHARS, items={"minLength": 1,
                                                                                 "maxLength": MAX_STOP_CHARS}),
        description=f"a stop string or a list of at most {MAX_STOP_STRINGS}, each of 1 to {MAX_STOP_CHARS} characters")
    seed: int | None = Field(default=None, **documented(minimum=SEED_RANGE[0], maximum=SEED_RANGE[1]))
    user: str | None = Field(default=None, description="ignored")
    # Accepted only at their neutral values, so clients that always send them keep working.
    presence_penalty: float = only(0.0, why="only 0; use repetition_penalty")
    frequency_penalty: float = only(0.0, why="only 0; use repetition_penalty")
    logit_bias: dict[str, float] | None = Field(default=None, description="not supported: null or {}",
                                                **documented(maxProperties=0))
    # vLLM-style extensions.
    top_k: int = Field(default=0, ge=0, description="0 turns it off", **documented(maximum=MAX_TOP_K))
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, **documented(
        minimum=REPETITION_PENALTY_RANGE[0], maximum=REPETITION_PENALTY_RANGE[1]))
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, **documented(
        maxItems=MAX_STOP_TOKEN_IDS, items={"type": "integer", "minimum": 0, "maximum": MAX_TOP_K}))

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        return stops

    def check_supported(self) -> None:
        """Reject requests for features that are parsed but not implemented."""
        if self.n != 1:
            raise APIError(400, f"n={self.n} is not supported: this server returns one choice per request; "
                                "send n separate requests instead", param="n")
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise APIError(400, f"{name} is not supported; use repetition_penalty instead", param=name)
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        description="one prompt: a non-empty text or list of token ids (a list of one of either is taken too)")
    echo: bool = only(False, why="not supported")
    logprobs: int | None = only(None, why="not supported")
    best_of: int | None = only(None, 1, why="only 1")
    suffix: str | None = only(None, "", why="not supported")

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported", param="best_of")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: text or token ids. Batches of several are refused."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise APIError(400, f"a batch of {len(prompt)} prompts is not supported: "
                                    "send one request per prompt", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise APIError(400, "prompt is empty", param="prompt")
        return prompt


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def as_template_input(self) -> dict[str, str]:
        content = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        # Chat templates know "system"; OpenAI's newer "developer" role means the same thing.
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, description="rendered with the model's chat template")
    max_completion_tokens: int | None = Field(default=None, ge=1, description="max_tokens by its newer name")
    logprobs: bool = only(False, why="not supported")
    top_logprobs: int | None = only(None, why="not supported")
    tools: list[Any] | None = Field(default=None, description="not supported: null or []", **documented(maxItems=0))
    tool_choice: Any = only(None, "none", why="not supported")
    response_format: dict[str, Any] | None = only(None, {"type": "text"}, why="only {\"type\": \"text\"}")

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs is not None:
            raise APIError(400, "logprobs is not supported", param="logprobs")
        if self.tools or self.tool_choice not in (None, "none"):
            raise APIError(400, "tools are not supported", param="tools")
        if self.response_format not in (None, {"type": "text"}):
            raise APIError(400, "only response_format {\"type\": \"text\"} is supported", param="response_format")
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise APIError(400, "max_tokens and max_completion_tokens disagree; send one of them",
                           param="max_completion_tokens")


def parse_body(raw: bytes, model: type[_SamplingFields]) -> _SamplingFields:
    """Parse and validate a JSON body; every failure becomes a 400 naming the offending field."""
    try:
        request = model.model_validate_json(raw)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        if error["type"] == "json_invalid":
            raise APIError(400, f"request body is not valid JSON: {error['msg']}", code="invalid_json") from None
        param, union_tags = _split_loc(error["loc"])
        if union_tags:
            # A union field: pydantic reports one error per member; name the members instead.
            tags = [t for e in exc.errors() if _split_loc(e["loc"])[0] == param
                    for t in _split_loc(e["loc"])[1][:1]]
            message = f"{param}: expected one of {', '.join(dict.fromkeys(tags))}"
        elif error["type"] == "extra_forbidden":
            message = f"unrecognized request argument: {param}"
        else:
            message = f"{param or 'body'}: {error['msg'].removeprefix('Value error, ')}"
        raise APIError(400, message, param=param) from None
    request.check_supported()
    return request


def _split_loc(loc: tuple) -> tuple[str | None, list[str]]:
    """('messages', 0, 'content', 'list[ContentPart]', 0) -> ('messages.0.content', ['list[ContentPart]', ...]).

    Field names here are lower-case identifiers; pydantic's union-member tags are type names.
    """
    parts = [str(p) for p in loc]
    for i, part in enumerate(parts):
        if "[" in part or part[:1].isupper() or part in ("str", "int", "float", "bool", "none"):
            return ".".join(parts[:i]) or None, parts[i:]
    return ".".join(parts) or None, []


def max_tokens_for(request: _SamplingFields, prompt_len: int, max_context: int, default: int | None) -> int:
    """The output budget: the request's own, else `default`, else what the context leaves.

    A prompt that leaves no room, or a budget past the context, is a 400 (as vLLM does) rather than
    a silent truncation.
    """
    asked = getattr(request, "max_completion_tokens", None) or request.max_tokens
    room = max_context - prompt_len
    if room < 1:
        raise APIError(400, f"the prompt has {prompt_len} tokens, but this model's context is {max_context} "
                            "tokens and leaves no room to generate; shorten the prompt",
                       param="messages" if hasattr(request, "messages") else "prompt",
                       code="context_length_exceeded")
    if asked is None:
        return min(default, room) if default is not None else room
    if asked > room:
        raise APIError(400, f"this model's context is {max_context} tokens, but {prompt_len + asked} were "
                            f"requested ({prompt_len} in the prompt, {asked} to generate); lower max_tokens "
                            f"to at most {room} or shorten the prompt",
                       param="max_tokens", code="context_length_exceeded")
    return asked


def sampling_kwargs(request: _SamplingFields, max_tokens: int) -> dict[str, Any]:
    """Keyword arguments for the engine's SamplingParams."""
    return {"max_tokens": max_tokens, "temperature": request.temperature, "top_p": request.top_p,
            "top_k": request.top_k, "min_p": request.min_p, "seed": request.seed,
            "repetition_penalty": request.repetition_penalty, "stop": list(request.stop or []),
            "stop_token_ids": list(request.stop_token_ids), "ignore_eos": request.ignore_eos}
