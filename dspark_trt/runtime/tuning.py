"""Every tuning value of the runtime, in one frozen dataclass.

``Runtime.load(..., tuning=RuntimeTuning(...))`` takes one; the defaults are what the runtime ran with
before the values were gathered here. Each field's docstring says what it trades off; ``docs/tuning.md``
is generated from them (``python scripts/tuning_doc.py``; a test fails when it is stale).
Change a value for an experiment with ``dataclasses.replace``; never by patching modules.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import textwrap
from dataclasses import dataclass, field, fields
from pathlib import Path

from dspark_trt.errors import DsparkError

__all__ = ["CorrectionTuning", "DriftTuning", "ProfileTuning", "RuntimeTuning", "tuning_markdown"]


@dataclass(frozen=True)
class DriftTuning:
    """Online drift correction of the profiled cost tables (costs/table.py)."""

    alpha: float = 0.1
    """Weight of one observed call in the log-ratio observed/profiled. Larger follows a changing machine
    faster and lets single slow calls move the tables more."""

    max_step: float = 0.06
    """Largest change of the log correction per observation: one 10x outlier cannot wreck the table."""

    bound_low: float = 1 / 64
    """Smallest correction factor applied to the profile. Wide on purpose: a profile measured under heavy
    load can be 10-20x off, and a bound inside that leaves the runtime stuck on it for the whole run
    (measured: draft calls profiled 20x too dear, bound 0.25, adaptive never drafted again). One outlier
    cannot reach it: each observation moves the correction by at most max_step, and a jump needs
    catch_up disagreeing calls in a row."""

    bound_high: float = 64.0
    """Largest correction factor applied to the profile (see bound_low)."""

    residual_rate: float = 0.25
    """Learning rate of the per-size residual relative to the global term. Slower residuals keep the
    overshoot small that a size observed only while the global term catches up would keep."""

    catch_up: int = 5
    """Observed calls in a row that must each disagree with the corrected table by more than refine_margin,
    on the same side, before the correction jumps to their median instead of walking there at max_step per
    call (a profile 3x off would take ~40 calls). 0: never jump. Larger resists a run of slow calls on a
    busy machine and recovers from a wrong profile later."""

    shape_alpha: float = 0.05
    """Weight of one observed target call in the call-shape model's drift (per call width)."""

    shape_refit_every: int = 64
    """Observed target calls between checks of the call-shape model's depth slope (how cost grows with the
    tokens and the padded query depth), refitted from those calls when calls of different depths at one width
    are off the model by more than refine_margin apart; the drift corrects only the level per width, so
    without refits a profile whose slope is wrong (a flat verify curve) stays wrong. 0: never refit."""

    refine_margin: float = 0.25
    """At close, a full profile whose observed calls disagree with it by more than this (a drift factor
    above 1 + margin or below 1 / (1 + margin) at some observed size) is replaced by its drift-corrected
    tables. Quick profiles are always replaced once observed enough."""

    refine_observations: int = 64
    """Observed calls (verify and draft together) needed before a full profile is re-fitted at close."""


@dataclass(frozen=True)
class CorrectionTuning:
    """Online recalibration of the draft's survivals from verification outcomes (survival_correction.py)."""

    enabled: bool = True
    """Correct survivals online. Off: the solver trusts the head's offline calibration as is."""

    damping: float = 2.0
    """Pseudo-curvature added to the Newton step: keeps the first steps finite; larger moves slower."""

    forget: float = 0.02
    """Fraction of the curvature sum dropped per step: memory of ~1/forget steps, so the shift keeps
    tracking a changing workload at the price of more noise."""

    max_step: float = 0.5
    """Largest change of a position's logit shift per step."""

    bound: float = 5.0
    """Limit of a logit shift (a factor e^bound on the odds)."""

    warmup: int = 8
    """Observations of a position before its shift is applied (until then it is only learned)."""

    observe_batch: int = 32
    """Verification outcomes buffered before the correction learns from them: one vectorised update over
    more rows instead of a numpy round per step, at the price of a slightly staler correction."""

    explore_every: int = 8
    """When the solver admits no draft this many steps running, verify one draft per request anyway:
    survivals that are too pessimistic would otherwise never be shown wrong. Smaller recovers sooner
    and wastes more verify work where drafting truly does not pay."""


@dataclass(frozen=True)
class ProfileTuning:
    """Measuring the step-cost profile at start-up or with `dspark-trt profile` (costs/profiling.py)."""

    repeats: int = 3
    """Timed repeats per point at start-up (the median is kept; `dspark-trt profile --repeats` sets its
    own). More repeats resist a noisy machine and make start-up slower."""

    past: int = 128
    """Cached tokens per row in the profile's calls (the call-shape model also measures other pasts)."""

    cheap_ms: float = 5.0
    """Calls faster than this are timed several times per measurement (their median), so every point
    weighs about this much work: a call of a millisecond is at the mercy of one scheduler hiccup."""

    max_inner: int = 7
    """Most timings of one cheap call per measurement."""

    shape_rounds: int = 3
    """Round-robin rounds (at least) over the call shapes the call-shape model is fitted to. More rounds
    resist a loaded machine and make profiling slower."""

    shape_quantile: float = 25.0
    """Percentile of a call shape's timings kept: preemption by other processes only ever adds time, so a
    low quantile keeps one slowed-down shape from pulling the whole fit off."""

    keep_quantile: float = 75.0
    """Percentile of a verify/draft point's timings at or below which they are kept (the rest is dropped
    as outliers: preemption only ever adds time). 100 keeps every timing."""

    max_spread: float = 0.15
    """A point gets further round-robin replays while the relative spread (IQR / median) of its kept
    timings is above this, up to max_repeats. Smaller measures longer and more precisely."""

    max_repeats: int = 12
    """Most timed replays of one verify/draft point while its spread is above max_spread."""

    persist_spread: float = 0.35
    """A measured profile whose spread (median over its points) stays above this is used for the run but
    not saved (start-up), or refused by `dspark-trt profile` without --force: the machine was too busy
    for its timings to be a starting point worth keeping."""


@dataclass(frozen=True)
class RuntimeTuning:
    """Every knob of the runtime's scheduling; see docs/tuning.md for the generated list."""

    prefill_chunk: int = 256
    """Most prompt tokens of one request fed in one call (target or draft catch-up). Larger finishes
    prompts in fewer steps and makes a step that carries one slower for everyone decoding in it."""

    prefill_batching: bool = True
    """Arriving prompts may wait a few steps to share a prefill call (prefill_batching.py)."""

    prefill_max_wait: int = 4
    """Steps a prompt may wait for company, whatever the model says: a bound on added latency."""

    cost_observe_every: int = 4
    """Feed one step in this many to the cost tables' drift correction. The correction moves slowly
    anyway; every feed costs a table rebuild."""

    settle_calls: int = 4
    """Calls after the engine switched graphs that the profile does not time and the cost model learns from
    only where a switch cannot explain them (call_shape.py: dearer than the model by more than a switch's
    price). After running another graph (ONNX Runtime: the packed graph after the decoding graph, the greedy
    twin after the sampling graph, or back), a graph's first calls are slower: at 16 rows a plain call took
    1.45x, 1.4x, 1.27x, 1.2x and 1.08x its settled time. Learned from as they were, they priced each kind at
    what a switch costs (plain decoding at 2-2.5x its price while adaptive drafted). 0: learn from every call."""

    plan_every: int = 8
    """Steps a draft-depth plan is reused per batch shape before it is made again."""

    switch_calls: float = 2.5
    """What a switch from plain decoding to verifying and back costs, in plain calls of the step's width, where
    the backend runs plain decoding on a graph of its own (ONNX Runtime's decoding graph): after a drafting
    step at 4 requests the decoding graph's next calls took 1.9, 1.5, 1.3, 1.15 and 1.03x their settled time
    (16 requests: 1.9, 1.35, 1.25, 1.1), and the verify graph's first call after plain ones ~1.3x its own.
    The depth planner charges it to a stretch of drafting that starts from plain decoding (over the steps such
    stretches lasted at the load, plan_every until one ends) and to each exploration. The starting point only:
    the runtime learns the price from the calls after each switch (costs/switch.py), this counting as a few
    switches. 0: unpriced until learned."""

    plan_headroom: int = 1
    """Draft steps planned beyond the prior's optimum, so live survivals can ask for more. More headroom
    drafts tokens the solver may not verify."""

    explore_budget: float = 0.1
    """While the cost model plans no drafting, the share of step time that scheduled exploration (drafting as
    deep as pays best with the starting survival profile, all of it verified, every call observed) may
    spend, per load; it falls as 1/(1 + n)^2, n the
    explorations there that confirmed the plan not to draft, to a fiftieth of this. Larger recovers sooner from
    a profile too pessimistic about drafting and costs more where drafting truly does not pay; 0: never
    explore."""

    plain_check_every: int = 8
    """While the cost model plans drafting at a load where it never observed plain calls, drafting steps
    before a stretch of plain steps (settle_calls + 3 of them) shows what plain decoding costs there: a model
    that prices drafting too cheaply is otherwise never shown wrong. Once per load; 0: never check."""

    call_test: bool = True
    """Make a further draft call only if its expected surplus pays for its time at the recent output
    rate. Off: a request drafts on while its own next survival clears the break-even."""

    stop_factor: float = 1.0
    """Keep drafting while the next survival is predicted above this times the last break-even
    survival. Larger stops drafting earlier (fewer wasted drafts, fewer chances)."""

    break_even_span: int = 4
    """Fewest verified tokens the break-even survival averages the marginal cost over (the runtime spans
    at least a layer of the call: one more token for every decode row)."""

    rate_alpha: float = 0.1
    """Weight of one step in the recent output rate (tokens per ms), the value of a millisecond."""

    arrivals_alpha: float = 0.1
    """Weight of one step in the recent prompts admitted per step (prefill batching)."""

    overhead_window: int = 15
    """Steps of a kind and load whose median unpriced time is the step overhead (costs/overhead.py): more
    follows a change of load or machine more slowly, fewer lets a few slow steps (a collection, the OS)
    move the figure the draft-depth planner reads."""

    max_verify_tokens: int = 0
    """Most tokens one step may verify over all decode requests (each request's next token plus its
    verified drafts), on top of the engine's own limit (the manifest's max_tokens_per_step and the cost
    profile's largest size), like vLLM's cap on a step's logits. 0: the engine's limit only. Smaller
    bounds a step's latency at high load at the price of fewer verified drafts."""

    explain_window: int = 64
    """Steps summed before predicted and measured (expected vs accepted drafts, modelled vs measured step
    ms) are compared for the one warning that says they disagree (runtime/explain.py)."""

    explain_tolerance: float = 0.25
    """Relative gap between predicted and measured, over a whole window, that earns the warning when
    explain_persist windows in a row have it."""

    explain_persist: int = 3
    """Windows in a row apart before the warning (one window apart happens while the drift catches up)."""

    prior_acceptance: float = 0.7
    """Per-position acceptance of the survival profile before any step is seen (S_k = p^k)."""

    prior_decay: float = 1 / 256
    """Weight of one request's step in the running survival profile (~1/prior_decay rows of memory)."""

    prior_rows: int = 4
    """Rows the starting survival profile (prior_acceptance^k) counts as in the running one. 0: the first
    step's rows replace it, and a fresh runtime at 1 request whose first drafts the head scored low (all of
    them accepted) planned little or no drafting: on one-token prompts 6 of 16 starts drafted in most steps
    of their first 16 requests, one ran at `off`'s speed for 64 (4: 7 of 8; 16: 11 of 12, but 0.5x capacity's
    TPOT p50 1.044x fixed:3's on the simulated open loop, against 1.017 with 4; lab notes)."""

    drift: DriftTuning = field(default_factory=DriftTuning)
    """Online drift correction of the cost tables."""

    correction: CorrectionTuning = field(default_factory=CorrectionTuning)
    """Online recalibration of survivals."""

    profile: ProfileTuning = field(default_factory=ProfileTuning)
    """Measuring the step-cost profile."""

    def validate(self) -> "RuntimeTuning":
        """Raise DsparkError naming the first field out of range; return self."""
        for owner, name, value in _leaves(self):
            bad = _check(owner, name, value)
            if bad:
                raise DsparkError(f"tuning {name} = {value!r}: {bad}")
        return self

    @classmethod
    def from_dict(cls, data: dict) -> "RuntimeTuning":
        """From a (possibly partial) dict of field names, sub-dataclasses as nested dicts."""
        return _build(cls, data, "").validate()

    @classmethod
    def from_json(cls, path_or_text) -> "RuntimeTuning":
        """From a JSON file path or a JSON text."""
        text = str(path_or_text)
        if not text.lstrip().startswith("{"):
            try:
                text = Path(text).read_text()
            except OSError as e:
                raise DsparkError(f"cannot read tuning file {path_or_text}: {e.strerror}") from None
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise DsparkError(f"tuning JSON is not valid: {e}") from None
        if not isinstance(data, dict):
            raise DsparkError("tuning JSON must be an object of field names")
        return cls.from_dict(data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_SUBS = {"drift": DriftTuning, "correction": CorrectionTuning, "profile": ProfileTuning}
_FRACTIONS = {"alpha", "forget", "rate_alpha", "arrivals_alpha",
              "prior_acceptance", "prior_decay", "residual_rate", "shape_alpha", "bound_low"}


def _build(cls, data: dict, prefix: str):
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise DsparkError(f"unknown tuning field {prefix}{unknown[0]}; known: {', '.join(sorted(names))}")
    kwargs = {}
    for k, v in data.items():
        sub = _SUBS.get(k) if cls is RuntimeTuning else None
        if sub is not None:
            if not isinstance(v, dict):
                raise DsparkError(f"tuning {k} must be an object of field names")
            v = _build(sub, v, f"{k}.")
        kwargs[k] = v
    return cls(**kwargs)


def _leaves(t, prefix: str = ""):
    for f in fields(t):
        v = getattr(t, f.name)
        if dataclasses.is_dataclass(v):
            yield from _leaves(v, f"{prefix}{f.name}.")
        else:
            yield type(t), prefix + f.name, v


def _check(owner, name: str, value) -> str | None:
    base = name.rsplit(".", 1)[-1]
    kind = {f.name: f.type for f in fields(owner)}[base]
    if kind == "bool":
        return None if isinstance(value, bool) else "must be true or false"
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        return "must be a whole number"
    if kind == "float" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value):
        return "must be a number"
    if base in _FRACTIONS:
        return None if 0 < value <= 1 else "must be in (0, 1]"
    if base in ("plan_headroom", "prior_rows", "max_verify_tokens", "explore_budget", "catch_up", "plain_check_every", "settle_calls",
                "switch_calls"):
        return None if value >= 0 else "must be >= 0"
    if base == "bound_high":
        return None if value >= 1 else "must be >= 1"
    return None if value > 0 else "must be > 0"


# ------------------------------------------------------------------------------------------ the doc

def _field_docs(cls) -> dict[str, str]:
    """Field docstrings (the string literal after each field) from the class source."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body, docs = tree.body[0].body, {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def _default(cls, f) -> str:
    v = getattr(cls(), f.name)
    return f"`{json.dumps(v)}`" if not dataclasses.is_dataclass(v) else "see below"


def tuning_markdown() -> str:
    """docs/tuning.md: every field, its default and what it trades off."""
    out = ["# Runtime tuning", "",
           "Generated from `dspark_trt/runtime/tuning.py` by `python scripts/tuning_doc.py`;",
           "a test fails when this file is stale. Pass `Runtime.load(..., tuning=RuntimeTuning(...))` or",
           "`RuntimeTuning.from_json(path)`; nested groups as JSON objects (`{\"drift\": {\"catch_up\": 8}}`).", ""]
    for cls, title in ((RuntimeTuning, "RuntimeTuning"), (DriftTuning, "drift"),
                       (CorrectionTuning, "correction"), (ProfileTuning, "profile")):
        out += [f"## {title}", "", " ".join(cls.__doc__.split()), "", "| field | default | what it trades off |",
                "|---|---|---|"]
        docs = _field_docs(cls)
        out += [f"| `{f.name}` | {_default(cls, f)} | {docs.get(f.name, '')} |" for f in fields(cls)]
        out.append("")
    return "\n".join(out)

