"""Stop sequences on decoded text (OpenAI's `stop`): the text of a growing list of token ids, given out in pieces,
ending before the first stop string it contains; while the text ends with the start of a stop string, that end is
held back, so a streamed piece never shows part of a stop string."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any


class StopText:
    """push(ids) -> (new piece of text, whether a stop string has appeared). The concatenated pieces are the text of
    all ids up to (not including) the first stop string, or, without one, the text of all ids."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    @property
    def text(self) -> str:
        """What has been given out so far."""
        return self.sent

    def _first_stop(self, text: str) -> int:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else -1

    def _held(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop string."""
        longest = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest

    def push(self, ids: list[int], final: bool = False) -> tuple[str, bool]:
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids)
        cut = self._first_stop(text)
        if cut >= 0:
            self.stopped = True
            text, final = text[:cut], True
        if final:
            piece = text[len(os.path.commonprefix([text, self.sent])):]
            self.sent = text
            return piece, self.stopped
        text = text.rstrip("\ufffd")  # maybe a character whose bytes have not all arrived
        text = text[:len(text) - self._held(text)]
        if not text.startswith(self.sent):  # a tokenizer that decodes a prefix differently from the whole
            return "", False
        piece, self.sent = text[len(self.sent):], text
        return piece, False
