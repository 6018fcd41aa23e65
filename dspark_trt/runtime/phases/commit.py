"""Commit: accepted drafts plus the target's token join each request; finished requests leave their slot."""

from __future__ import annotations

import time

from dspark_trt.runtime.request import Request

__all__ = ["Committer"]


class Committer:
    """Call order: ``commit_prompts(...)`` for prompt chunks fed ahead of the step's drafting, if any;
    ``commit(batch, drafted, result, plan)`` once per step, after verification."""

    def __init__(self, tokenizer, eos_ids, max_context: int, metrics, admission):
        self.tokenizer, self.eos_ids, self.max_context = tokenizer, frozenset(eos_ids), max_context
        self.metrics, self.admission = metrics, admission

    def commit(self, batch, drafted, result, plan=None) -> None:
        now = time.perf_counter()
        drafts, vl, accepted, next_tok = drafted.drafts, result.verify_lens, result.accepted, result.next_token
        # The step's prediction, kept in each decoding request's stats before commit may finish it (a
        # caller reads the stats as soon as it is done): the step measured up to now.
        predicted_ms = None
        if plan is not None and plan.predicted_ms is not None:
            predicted_ms = plan.predicted_ms + result.prefill_model_ms
        measured_ms = (now - batch.started) * 1e3 if predicted_ms is not None else 0.0
        for i, r in enumerate(batch.decode):
            a, L = int(accepted[i]), int(vl[i])
            d = drafts.get(r.id)
            new = (d.tokens[:a] if a else []) + [int(next_tok[i])]
            r.target_len += 1 + a
            if d is not None:
                fed = len(d.tokens) - 1  # the last drafted token was never fed to the draft
                r.draft_len = r.draft_len + min(a, fed)
            st = r.stats
            st.steps += 1
            st.verified_tokens += L + 1
            if L:
                st.predicted_accepted += float(sum(d.corrected[:L]))
                st.accepted += min(a, L)
            if predicted_ms is not None:
                st.predicted_step_ms += predicted_ms
                st.measured_step_ms += measured_ms
            for k in range(L):
                st.verified_per_position[k] += 1
                if k < a:
                    st.accepted_per_position[k] += 1
            self.metrics.record_acceptance(L, a)
            self.extend(r, new, now)
        if not result.prompts_committed:
            self.commit_prompts(result.chunked, next_tok[len(batch.decode):], now)
        self.admission.release_finished()

    def commit_prompts(self, chunked, next_tok, now: float | None = None) -> None:
        """Prompt chunks fed: each request's cache grows by its chunk; one whose whole prompt is cached now has
        its first token (the chunk's last row gave it)."""
        now = time.perf_counter() if now is None else now
        for (r, n), tok in zip(chunked, next_tok):
            r.target_len += n
            if r.uncached == 0:
                self.extend(r, [int(tok)], now)

    def extend(self, r: Request, new: list[int], now: float) -> None:
        """Append tokens to a request, up to its limits; finish it at a stop."""
        if r.finished:
            return
        new = new[:max(0, r.remaining())]
        reason = None
        stop = next((i for i, t in enumerate(new) if t in self.eos_ids), None) if r.config.stop_at_eos else None
        if stop is not None:
            new = new[:stop + 1]
            reason = "stop"
        if not r.stats.generated and new:
            r.stats.t_first = now
        r.tokens.extend(new)
        r.stats.generated += len(new)
        self.metrics.output_tokens += len(new)
        if r.pieces is not None and new:
            r.delivered.append(now)
            r.pieces.put(new)
        if r.config.stop and self._hit_stop_string(r):
            reason = "stop"
        if reason is None and r.remaining() <= 0:
            reason = "length"
        if reason is None and len(r.tokens) >= self.max_context:
            reason = "length"
        if reason:
            r.finish(reason)

    def _hit_stop_string(self, r: Request) -> bool:
        text = self.tokenizer.decode(r.generated_ids)
        return any(s and s in text for s in r.config.stop)
