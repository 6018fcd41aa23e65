"""Streaming text for one completion: token ids in, text deltas out, stop strings cut as the runtime cuts them.

Standard library only, so a Triton Python backend model can use it without the web stack.
"""

from __future__ import annotations


class TextStream:
    """Token ids -> text deltas for one streamed choice, with stop strings cut as the runtime cuts them.

    Decoding is incremental (a window from the last emitted token, as vLLM does), so a long completion does
    not decode its whole output at every step. Text that could be the start of a stop string is held back
    until it is known not to be one; `finish` decodes the whole output once so the deltas add up to exactly
    the text the non-streaming answer has.
    """

    def __init__(self, decode, stops: list[str]):
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix = 0  # window start (token index)
        self.read = 0  # tokens already turned into self.text
        self.text = ""
        self.sent = 0  # characters of self.text already emitted
        self.cut: int | None = None

    def _stop_at(self, text: str) -> int | None:
        hits = [text.find(s) for s in self.stops if s in text]
        return min(hits) if hits else None

    def push(self, ids: list[int]) -> str:
        self.ids.extend(int(t) for t in ids)
        if self.cut is not None:
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
        if self.stops:
            self.cut = self._stop_at(self.text)
        end = self.cut if self.cut is not None else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        piece = self.text[self.sent:end]
        self.sent = end
        return piece

    def finish(self, finish_reason: str | None) -> str:
        full = self.decode(self.ids)
        if finish_reason == "stop" and self.stops:
            cut = self._stop_at(full)
            if cut is not None:
                full = full[:cut]
        piece = full[self.sent:] if len(full) > self.sent else ""
        self.sent = max(self.sent, len(full))
        return piece
