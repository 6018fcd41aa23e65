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
    is made of) weigh by their tokens and one small call's fixed cost does not set the rate; and never
    above what the latest large call cost. A rate too dear is self-sustaining (a catch-up priced too dear
    is not explored, so never timed again) where one too cheap is not (the exploration it lets through is
    timed, and settled at what it cost): a fresh runtime's first catch-up, timed cold, cost 0.7-2.9 ms a
    token, 30-60x the rate after, and kept adaptive from exploring, so from drafting (in a 10 s open loop,
    never). 0 before any catch-up was timed: the first one finds out."""

    LARGE = 16  # tokens: a call at least this large prices by its tokens, not by its fixed cost

    def __init__(self, decay: float = 0.8):
        self.decay = decay
        self._ms = self._tokens = 0.0
        self._latest: float | None = None  # ms a token of the latest large call

    def observe(self, tokens: int, ms: float) -> None:
        if tokens > 0:
            self._ms = self.decay * self._ms + max(0.0, ms)
            self._tokens = self.decay * self._tokens + tokens
            if tokens >= self.LARGE:
                self._latest = max(0.0, ms) / tokens

    def ms(self, tokens: int, ceiling: float | None = None) -> float:
        """Modelled ms of catching up `tokens` tokens; ceiling: the most ms a token is priced at (None: no
        bound). One timed call sets the rate until the next is timed, so a cold first one is bounded too."""
        if not self._tokens:
            return 0.0
        rate = self._ms / self._tokens
        if self._latest is not None:
            rate = min(rate, self._latest)
        return tokens * (rate if ceiling is None else min(rate, ceiling))
