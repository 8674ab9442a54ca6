"""Text for a stream of tokens, piece by piece, with stop strings.

Decoding one token alone is wrong for byte-level and sentencepiece tokenizers (a character can
span tokens, a leading space depends on the token before), so each step decodes a short window
and emits only what it adds, holding back an incomplete character ("\ufffd"). Text that could be
the start of a stop string is held back too, so a stream never shows text the stop removes.
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_ids[-6:])   # a little context, for spaces and merged characters
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = stop
        self.text = ""          # all text so far (after a stop: up to the stop string)
        self.emitted = 0        # characters of self.text already handed out
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add a token; returns the text that may be shown now. Sets .stopped on a stop string."""
        if self.tokenizer is None:
            return ""
        self.ids.append(token_id)
        before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
        after = self.tokenizer.decode(self.ids[self.prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            start = len(self.text)
            self.text += after[len(before):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._check_stop(start)
        return self._release(final=self.stopped)

    def flush(self) -> str:
        """The held-back text, when the request ends for another reason than a stop string: with
        the tokens still waiting to complete a character, decoded as they are."""
        if self.tokenizer is not None and not self.stopped and self.read_offset < len(self.ids):
            before = self.tokenizer.decode(self.ids[self.prefix_offset:self.read_offset])
            start = len(self.text)
            self.text += self.tokenizer.decode(self.ids[self.prefix_offset:])[len(before):]
            self.read_offset = len(self.ids)
            self._check_stop(start)
        return self._release(final=True)

    def _check_stop(self, start: int) -> None:
        # a stop string may straddle the old text and the new piece; the earliest one wins
        hits = [at for stop in self.stop if (at := self.text.find(stop, max(0, start - len(stop) + 1))) != -1]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text)
        if not final:
            end -= self._held()
        piece = self.text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return piece

    def _held(self) -> int:
        """Length of the longest tail of the text that begins some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if stop.startswith(self.text[-k:]):
                    longest = k
                    break
        return longest
