"""argparse types shared by every `warploop` command (the CLI modules of bundle, llm and bench), kept
below them all so that none imports the top-level CLI."""
from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type for counts (tokens, repeats, steps): 0 and negatives are refused before any work."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer (1 or more), got {text}")
    return value


def port(text: str) -> int:
    """argparse type for a TCP port: 0 (a free one) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be from 0 (a free port) to 65535, got {text}")
    return value
