"""Strings that device code refers to by number: print formats, file paths, host function names.

Device code cannot carry Python strings, so it carries an id. The id is a hash of the text, not a
counter, so the same string has the same id in every process: a kernel compiled ahead of time on
another machine (with the id baked in as a constant) still names the right format on this one.
The host must have interned the text too (importing the module that defines it does that).
"""
from __future__ import annotations

import hashlib
import threading

_lock = threading.Lock()
_texts: dict[int, str] = {}


def string_id(text: str) -> int:
    """The id of `text` (a positive 62-bit int) without registering it."""
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 2) or 1


def intern(text: str) -> int:
    """Register `text` and return its id; registering the same text twice returns the same id."""
    if not isinstance(text, str):
        raise TypeError(f"intern() takes a str, got {type(text).__name__}")
    sid = string_id(text)
    with _lock:
        known = _texts.setdefault(sid, text)
    if known != text:
        raise ValueError(f"string id collision between {known!r} and {text!r}; rename one of them")
    return sid


def lookup(sid: int) -> str | None:
    """The text registered under `sid`, or None."""
    return _texts.get(int(sid))
