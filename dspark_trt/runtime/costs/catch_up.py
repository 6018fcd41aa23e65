"""What feeding the draft text it has not seen costs per token, learned from the drafter's own calls.

Before a request drafts, the draft takes in what it has not seen: its prompt, and the text generated
while it did not draft. Scheduled exploration pays that for every request it drafts for, so it prices it
before exploring (phases/exploration.py): at 16 requests just started, the first exploration fed 16
prompts through the draft and cost five plain steps, far beyond the budget it was charged.
"""

from __future__ import annotations

__all__ = ["CatchUpRate"]


class CatchUpRate:
    """Recent catch-up ms per token fed: a ratio of decayed sums, so large calls (what a long catch-up
    is made of) weigh by their tokens and one small call's fixed cost does not set the rate.
    0 before any catch-up was timed: the first one finds out."""

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._ms = self._tokens = 0.0

    def observe(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            self._ms = self.decay * self._ms + max(0.0, ms)
            self._tokens = self.decay * self._tokens + tokens

    def ms(self, tokens: int) -> float:
        """Modelled ms of catching up `tokens` tokens."""
        return tokens * self._ms / self._tokens if self._tokens else 0.0
