"""Tokenizer: `tokenizers` for the text, tokenizer_config.json for special tokens and the chat template.

The chat template is rendered with jinja2 the way transformers renders it (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`, `strftime_now`), so templates written for it work here,
within the bounds of warploop.llm.chat_template.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

from warploop.llm.chat_template import ChatTemplateError, render_chat_template


class TokenizerError(ValueError):
    """The tokenizer files are missing or malformed, or the model has no chat template."""


def _content(token) -> str | None:
    """Special tokens are stored as a string or as an AddedToken dict {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


class Tokenizer:
    def __init__(self, model_dir: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        model_dir = Path(model_dir)
        file = model_dir / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file} does not exist; the model directory needs a Hugging Face tokenizer.json")
        try:
            hf = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for any malformed file
            raise TokenizerError(f"{file} is not a valid tokenizer file ({e}); download it again or "
                                 "re-save it with tokenizers") from None
        config_file = model_dir / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise TokenizerError(f"{config_file} is not valid JSON: {e}") from None
        if not isinstance(config, dict):
            raise TokenizerError(f"{config_file} must hold a JSON object, got a {type(config).__name__}; "
                                 "download it again")
        self._setup(hf, config, _chat_template(config, model_dir),
                    set(extra_eos_ids) | _generation_eos(model_dir))

    @classmethod
    def from_parts(cls, tokenizer, config: dict, eos_token_ids: set[int]) -> Tokenizer:
        """From a `tokenizers.Tokenizer` and a tokenizer_config-style dict (GGUF files carry no tokenizer.json)."""
        self = cls.__new__(cls)
        self._setup(tokenizer, config, config.get("chat_template"), set(eos_token_ids))
        return self

    def _setup(self, tokenizer, config: dict, chat_template: str | None, eos: set[int]) -> None:
        self._tok = tokenizer
        self.special_tokens = {k: _content(v) for k, v in config.items()
                               if k.endswith("_token") and _content(v) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self._add_bos = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        if self.eos_token is not None and self._tok.token_to_id(self.eos_token) is not None:
            eos.add(self._tok.token_to_id(self.eos_token))
        self.eos_token_ids: set[int] = eos

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token, in characters of its vocabulary entry. Byte-level vocabularies spell
        each byte as one character, so a text of n characters has at least n / max_token_chars tokens."""
        return max(map(len, self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. A text that already starts with the BOS token (a rendered chat
        template does) does not get a second one."""
        if add_special_tokens and self.bos_token and text.startswith(self.bos_token):
            add_special_tokens = False
        # The batch entry points release the GIL, so a long prompt tokenised on the server's thread
        # pool does not stall its event loop; the _fast one also skips the character offsets.
        encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        ids = encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        if add_special_tokens and self._add_bos and bos_id is not None and ids[:1] != [bos_id]:
            ids = [bos_id, *ids]  # old Llama tokenizers add BOS through tokenizer_config, not tokenizer.json
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        if self.chat_template is None:
            raise TokenizerError("this model has no chat template (none in tokenizer_config.json or "
                                 "chat_template.jinja); send a plain prompt to /v1/completions instead")
        try:
            return render_chat_template(self.chat_template, messages=messages,
                                        add_generation_prompt=add_generation_prompt, **self.special_tokens, **extra)
        except ChatTemplateError as e:
            raise TokenizerError(str(e)) from None


def _chat_template(config: dict, model_dir: Path) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: take "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    jinja_file = model_dir / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8", errors="replace")
    if template is not None and not isinstance(template, str):
        raise TokenizerError(f"chat_template in {model_dir / 'tokenizer_config.json'} must be a string or a list "
                             f"of named templates, got {type(template).__name__}")
    return template


def _generation_eos(model_dir: Path) -> set[int]:
    """Instruct models list extra end-of-turn ids in generation_config.json (Llama 3: <|eot_id|>)."""
    file = model_dir / "generation_config.json"
    if not file.is_file():
        return set()
    try:
        config = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return set()  # optional file: a broken one only loses the extra end-of-turn ids
    value = config.get("eos_token_id") if isinstance(config, dict) else None
    values = [value] if isinstance(value, int) else value if isinstance(value, list) else []
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}

