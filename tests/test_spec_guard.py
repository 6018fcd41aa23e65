"""The measured guard on speculating at all: a spec for SpecGuard (pure python, simulated rates)."""

from dspark_trt.runtime.spec_guard import SpecGuard
from dspark_trt.runtime.tuning import GuardTuning

DEFAULTS = GuardTuning()


def run(guard, rates, steps, n_decode=32, model="spec"):
    """Drive the guard for `steps` steps where each arm yields a fixed output rate and the cost model
    always chooses `model`; returns the arms run."""
    arms = []
    for _ in range(steps):
        arm = guard.arm(n_decode, model)
        guard.record(n_decode, arm, rates[arm] * 10.0, 10.0)
        arms.append(arm)
    return arms


def test_when_plain_is_faster_the_guard_mostly_runs_plain():
    arms = run(SpecGuard(), {"spec": 1.0, "plain": 1.7}, 2000)
    assert arms[: DEFAULTS.first] == ["spec"] * DEFAULTS.first  # starts with the model's choice
    assert arms[-500:].count("plain") > 480  # then trials of spec are rare
    assert arms.count("spec") < 100


def test_when_spec_is_faster_it_keeps_speculating_with_rare_trials():
    arms = run(SpecGuard(), {"spec": 1.6, "plain": 1.0}, 3000)
    assert arms.count("plain") < 0.03 * len(arms)  # trial spacing grows with the gap (loss budget ~1-2%)
    assert "plain" in arms  # but the other arm is still measured now and then


def test_close_rates_keep_spec_and_buckets_are_separate():
    g = SpecGuard()
    arms = run(g, {"spec": 1.0, "plain": 1.02}, 500)  # within MARGIN: no reason to stop speculating
    assert arms[-100:].count("spec") > 75  # short trials of plain (equal rates: they cost nothing)
    assert run(g, {"spec": 1.0, "plain": 1.0}, 1, n_decode=1) == ["spec"]  # a new load bucket starts fresh
    assert set(g.report()) == {1, 32}


def test_rates_are_what_the_steps_fed_them():
    """The guard measures what it is given (the runtime leaves out the prefill that lands on a step and
    the draft's catch-up after a switch): a 60 ms step counts as 60 ms; a step of the arm it did not
    choose is ignored."""
    g = SpecGuard()
    arm = g.arm(64)
    g.record(64, arm, 12.0, 60.0)  # 10 ms of steps + 50 ms catch-up
    for _ in range(5):
        g.record(64, g.arm(64), 12.0, 10.0)
    assert g.report()[64]["spec_tok_per_ms"] < 1.0
    g.record(64, "plain", 50.0, 10.0)  # a step of the arm not running is ignored
    assert g.report()[64]["plain_tok_per_ms"] is None


def test_near_a_tie_the_guard_stays_on_its_arm_while_the_model_flips():
    g = SpecGuard()
    arms = []
    for i in range(600):
        model = "spec" if (i // 3) % 2 == 0 else "plain"  # a model flipping every 3 steps
        arm = g.arm(32, model)
        g.record(32, arm, 32.0 * (1.0 if arm == "plain" else 1.01), 30.0)
        arms.append(arm)
    flips = sum(a != b for a, b in zip(arms[200:], arms[201:]))
    assert flips < 20  # trials only, not every model flip


def test_where_the_model_would_not_draft_but_drafting_is_faster_the_guard_drafts():
    arms = run(SpecGuard(), {"spec": 1.3, "plain": 1.0}, 2000, model="plain")
    assert arms[: DEFAULTS.first] == ["plain"] * DEFAULTS.first  # follows the model until measured
    assert arms[-500:].count("spec") > 470  # trials of plain every ~230 steps (loss budget)


def test_where_the_model_would_not_draft_and_is_right_spec_trials_are_rare():
    arms = run(SpecGuard(), {"spec": 0.7, "plain": 1.0}, 3000, model="plain")
    assert "spec" in arms and arms.count("spec") < 0.035 * len(arms)


def test_noisy_low_load_steps_do_not_flip_the_model_choice():
    """One request: a drafting step emits 1..6 tokens. Spec averages 3.5 tokens in 12 ms (0.29/ms) against
    plain's 1 token in 7 ms (0.14/ms); even with a trial that happens to draw only 1-token steps, the
    guard must not conclude that plain is faster."""
    import random

    rng = random.Random(0)
    g = SpecGuard()
    arms = []
    for i in range(3000):
        arm = g.arm(1, "spec")
        unlucky = 16 <= i < 40  # the first trials' spec steps are all rejections
        tokens = 1 if arm == "plain" else (1 if unlucky else rng.randint(1, 6))
        g.record(1, arm, tokens, 7.0 if arm == "plain" else 12.0)
        arms.append(arm)
    assert arms[-1000:].count("spec") > 950


def test_rates_are_ratios_of_sums():
    g = SpecGuard()
    for tokens, ms in ((1, 10.0), (10, 10.0)):  # per-step rates 0.1 and 1.0 per ms
        g.record(4, g.arm(4), tokens, ms)
    d = 1 - DEFAULTS.alpha
    assert abs(g.report()[4]["spec_tok_per_ms"] - (10 + d * 1) / (10 + d * 10)) < 1e-12


def test_when_the_model_comes_to_prefer_drafting_the_guard_follows_unless_measured_slower():
    """A model that learned the true costs (say, from exploration) and now predicts drafting wins by more
    than the margin is followed, though the guard's home arm was plain and its noisy measurements of
    drafting are not significant; where measurement says drafting is clearly slower, the guard holds."""
    import numpy as np

    def drive(g, spec_rate, steps, model, lead):
        rng = np.random.default_rng(0)
        arms = []
        for _ in range(steps):
            arm = g.arm(32, model, lead)
            rate = spec_rate * max(0.0, rng.normal(1.0, 0.6)) if arm == "spec" else 1.0  # drafting steps vary
            g.record(32, arm, rate * 10.0, 10.0)
            arms.append(arm)
        return arms

    for spec_rate, lead, follows in ((1.1, 0.2, True), (1.1, 0.0, False), (0.6, 0.2, False)):
        g = SpecGuard()
        drive(g, spec_rate, 200, "plain", 0.2)  # the model preferred plain: home is plain
        arms = drive(g, spec_rate, 200, "spec", lead)
        assert (arms.count("spec") > 0.8 * len(arms)) == follows, (spec_rate, lead)
