"""The numpy reference of the dspark ops: hand-checked values, greedy equivalence, and losslessness of
speculative sampling (chi-square over many seeded draws)."""

import math

import numpy as np
import pytest

from dspark_trt.plugins import reference as ref

F32 = np.float32


def sigmoid(x):
    return 1.0 / (1.0 + np.exp(-np.asarray(x, np.float64)))


# -------------------------------------------------------------------------------------------- Survival
def test_survival_hand_values():
    temps = [1.0, 2.0, 4.0]
    x = np.array([[0.0, 0.0, 0.0], [2.0, -1.0, 3.0]], F32)
    got = ref.survival(x, np.array([1.0, 0.5], F32), np.array([0, 1]), temps)
    # row 1 starts at position 1: temperatures 2, 4, then clamped to the last (4)
    exp = np.array([[0.5, 0.25, 0.125],
                    0.5 * np.cumprod([sigmoid(2.0 / 2), sigmoid(-1.0 / 4), sigmoid(3.0 / 4)])])
    np.testing.assert_allclose(got, exp, rtol=1e-6)
    assert got.dtype == np.float32 and got.shape == (2, 3)


def test_survival_edges_are_exact_and_stable():
    temps = [1.0]
    x = np.array([[np.inf, 0.0], [-np.inf, 5.0], [-40.0, -40.0], [3.0, 1.0]], F32)
    prev = np.array([0.8, 1.0, 1.0, 0.0], F32)
    got = ref.survival(x, prev, np.array([0, 0, -3, 7]), temps)
    assert got[0, 0] == F32(0.8) and got[0, 1] == F32(0.4)  # +inf -> factor 1
    assert got[1, 0] == 0 and got[1, 1] == 0  # -inf -> factor 0, and it stays 0
    assert got[2, 1] > 0 and np.isclose(np.log(np.float64(got[2, 1])), -80.0, rtol=1e-5)  # log space: no underflow
    assert got[3].tolist() == [0.0, 0.0]  # prev = 0
    assert not np.isnan(got).any()
    assert np.all(np.diff(got, axis=1) <= 0)  # survival never increases along J


def test_survival_rejects_bad_temperatures():
    with pytest.raises(ValueError):
        ref.survival(np.zeros((1, 1), F32), np.ones(1, F32), np.zeros(1, np.int64), [1.0, -1.0])


# ---------------------------------------------------------------------------------------- GreedyAccept
def _packed(rows):
    return np.array(rows, F32)


def test_greedy_accept_hand_cases():
    ninf = -np.inf
    logits = _packed([
        [0, 5, 1],  # r0 (L=2): argmax 1 == x1 -> accept
        [2, 2, 1],  # tie -> lowest index 0 == x2 -> accept
        [0, 0, 9],  # bonus row: 2
        [ninf, ninf, ninf],  # r1 (L=1): all -inf -> argmax 0 != x1 = 2 -> reject, next 0
        [1, 2, 3],  # bonus row (unused)
        [3, 1, 3],  # r2 (L=0): plain greedy, tie -> 0
    ])
    tokens = np.array([1, 0, -7, 2, 99, 5])  # entries of last rows are ignored
    acc, nxt = ref.greedy_accept(logits, tokens, np.array([2, 1, 0]))
    assert acc.tolist() == [2, 0, 0] and nxt.tolist() == [2, 0, 0]
    assert acc.dtype == nxt.dtype == np.int64


def test_greedy_accept_rejects_invalid_tokens_and_checks_layout():
    logits = _packed([[0, 1], [1, 0]])
    assert ref.greedy_accept(logits, np.array([-1, 0]), np.array([1]))[0].tolist() == [0]
    assert ref.greedy_accept(logits, np.array([5, 0]), np.array([1]))[0].tolist() == [0]
    with pytest.raises(ValueError, match="packed rows"):
        ref.greedy_accept(logits, np.array([1, 0]), np.array([2]))
    with pytest.raises(ValueError, match=">= 0"):
        ref.greedy_accept(logits, np.array([1, 0]), np.array([-1, 2]))


# ---------------------------------------------------------------------------------------- SampleAccept
def _greedy_inputs(batch, one_hot_q: bool):
    b = dict(batch)
    b["temperature"] = np.where(np.arange(len(b["temperature"])) % 2 == 0, 0.0, -1.0).astype(F32)
    if one_hot_q:
        q = np.zeros_like(b["draft_probs"])
        valid = (b["draft_tokens"] >= 0) & (b["draft_tokens"] < q.shape[1])
        q[np.flatnonzero(valid), b["draft_tokens"][valid]] = 1.0
        b["draft_probs"] = q
    return b


@pytest.mark.parametrize("one_hot_q", [True, False])
def test_sample_accept_at_temperature_zero_equals_greedy(one_hot_q):
    for name, batch in ref.accept_cases(seed=3).items():
        b = _greedy_inputs(batch, one_hot_q)
        got = ref.sample_accept(**b)
        exp = ref.greedy_accept(b["logits"], b["draft_tokens"], b["verify_lens"])
        assert got[0].tolist() == exp[0].tolist() and got[1].tolist() == exp[1].tolist(), name


def test_sample_accept_hand_cases():
    lg = np.log(np.array([[0.5, 0.3, 0.2], [0.1, 0.1, 0.8], [0.2, 0.2, 0.6]], F32))
    q = np.array([[0.25, 0.5, 0.25], [1 / 3, 1 / 3, 1 / 3], [0, 0, 0]], F32)
    tok = np.array([0, 2, 0])  # x1 = 0 (p/q = 2, always accepted), x2 = 2 (p/q = 2.4, accepted)
    base = dict(logits=lg, draft_probs=q, draft_tokens=tok, verify_lens=np.array([2]),
                temperature=np.array([1.0], F32))
    acc, nxt = ref.sample_accept(**base, accept_uniforms=np.array([0.99, 0.99, 0], F32),
                                 sample_uniforms=np.array([0.7], F32))
    assert acc.tolist() == [2] and nxt.tolist() == [2]  # bonus from row 2: cdf [0.2, 0.4, 1.0] > 0.7 -> 2
    tok2 = np.array([1, 2, 0])  # x1 = 1: p/q = 0.6; u = 0.7 rejects; residual max(p - q, 0) = [0.25, 0, 0]
    acc, nxt = ref.sample_accept(**dict(base, draft_tokens=tok2), accept_uniforms=np.array([0.7, 0, 0], F32),
                                 sample_uniforms=np.array([0.99], F32))
    assert acc.tolist() == [0] and nxt.tolist() == [0]
    acc, _ = ref.sample_accept(**dict(base, draft_tokens=tok2), accept_uniforms=np.array([0.59, 0.5, 0], F32),
                               sample_uniforms=np.array([0.5], F32))
    assert acc.tolist() == [2]


def test_residual_that_sums_to_zero_falls_back_to_p():
    # q(x) = 0 for the drafted token's... here p == q on the rejected row, so max(p - q, 0) == 0
    lg = np.log(np.array([[0.5, 0.5], [0.5, 0.5]], F32))
    q = np.array([[0.5, 0.5], [0.5, 0.5]], F32)
    acc, nxt = ref.sample_accept(lg, q, np.array([1, 0]), np.array([1]), np.array([1.0], F32),
                                 np.array([F32(0.9999999), 0], F32), np.array([0.75], F32))
    assert acc.tolist() == [1]  # p/q = 1 accepts any u < 1
    acc, nxt = ref.sample_accept(lg, q, np.array([1, 0]), np.array([1]), np.array([1.0], F32),
                                 np.array([1.0, 0], F32), np.array([0.75], F32))
    assert acc.tolist() == [0] and nxt.tolist() == [1]  # u = 1 rejects; residual 0 -> draw from p


def test_inverse_cdf_clamps_to_last_positive_weight():
    w = np.array([0.2, 0.3, 0.5, 0.0, 0.0], F32)
    assert ref.inverse_cdf(w, 0.0) == 0 and ref.inverse_cdf(w, 0.2) == 1 and ref.inverse_cdf(w, 0.9) == 2
    assert ref.inverse_cdf(w, F32(1.0)) == 2  # u * total == total: no cdf exceeds it -> last index with w > 0


def test_argmax_lowest_and_target_probs():
    x = np.array([[1, 3, 3], [-np.inf, -np.inf, -np.inf], [np.inf, 0, np.inf]], F32)
    assert ref.argmax_lowest(x).tolist() == [1, 0, 0]
    p, am = ref.target_probs(x, np.array([1.0, 1.0, 2.0], F32))
    assert p[1].tolist() == [1, 0, 0] and p[2].tolist() == [1, 0, 0]  # non-finite row max -> one-hot
    np.testing.assert_allclose(p[0], np.exp([1, 3, 3]) / np.exp([1, 3, 3]).sum(), rtol=1e-6)
    p, _ = ref.target_probs(np.array([[1, 2, 3]], F32), np.array([0.0], F32))
    assert p.tolist() == [[0, 0, 1]]


def test_margins_flag_draws_near_boundaries():
    b = ref.accept_cases(seed=1)["random"]
    _, _, margin = ref.sample_accept_with_margin(**b)
    assert (margin >= 0).all() and np.isfinite(margin).all()
    moved = ref.redraw_near_boundaries(b, np.random.default_rng(0), tol=0.05)
    assert (ref.sample_accept_with_margin(**moved)[2] >= 0.05).all()


# ------------------------------------------------------------------------- losslessness (chi-square)
def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution (exact recursion for integer df)."""
    if df % 2 == 0:
        sf, term = 0.0, math.exp(-x / 2)
        for i in range(df // 2):
            sf += term
            term *= (x / 2) / (i + 1)
        return sf
    sf = math.erfc(math.sqrt(x / 2))
    for k in range(1, df, 2):  # sf(k + 2) = sf(k) + (x/2)^(k/2) e^(-x/2) / Gamma(k/2 + 1)
        sf += math.exp((k / 2) * math.log(x / 2) - x / 2 - math.lgamma(k / 2 + 1)) if x > 0 else 0.0
    return sf


def test_chi2_sf_matches_known_values():
    assert abs(chi2_sf(11.0705, 5) - 0.05) < 1e-4 and abs(chi2_sf(9.4877, 4) - 0.05) < 1e-4
    assert abs(chi2_sf(3.8415, 1) - 0.05) < 1e-4 and chi2_sf(0.0, 3) == pytest.approx(1.0)


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token with zero target probability"
    expected = n * probs[support]
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, int(support.sum()) - 1)


V = 6
L0 = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.5], F32)  # verifies x1
L1 = np.array([-1.0, 0.0, 2.5, 0.3, 0.3, -2.0], F32)  # bonus row
QS = {
    "reversed": np.exp(-L0) / np.exp(-L0).sum(),
    "zeros_where_p_positive": np.array([0, 0, 0.5, 0.5, 0, 0]),
    "one_token": np.array([0, 0, 0, 0, 1.0, 0]),
    "uniform": np.full(V, 1 / V),
}


def _simulate(q: np.ndarray, temperature: float, n: int, seed: int):
    rng = np.random.default_rng(seed)
    q = q.astype(F32)
    x = np.minimum((np.cumsum(q)[None, :] <= rng.random((n, 1))).sum(1), V - 1)  # x1 ~ q
    assert (q[x] > 0).all()
    logits = np.tile(np.stack([L0, L1]), (n, 1))
    tokens = np.stack([x, np.zeros(n, np.int64)], 1).reshape(-1)
    acc, nxt = ref.sample_accept(logits, np.tile(q, (2 * n, 1)), tokens, np.ones(n, np.int64),
                                 np.full(n, temperature, F32), rng.random(2 * n).astype(F32),
                                 rng.random(n).astype(F32))
    return x, acc, nxt


def _p(row, temperature):
    z = np.float64(row) / temperature
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("qname,temperature", [(k, 1.0) for k in QS] + [("reversed", 0.6)])
def test_first_emitted_token_is_distributed_as_p(qname, temperature):
    n = 50000
    x, acc, nxt = _simulate(QS[qname], temperature, n, seed=sorted(QS).index(qname) + int(temperature * 10))
    first = np.where(acc >= 1, x, nxt)  # the token emitted at the first draft position
    p0, p1 = _p(L0, temperature), _p(L1, temperature)
    pval = chi2_pvalue(np.bincount(first, minlength=V), p0)
    assert pval > 1e-3, f"first token not ~ p (q={qname}, p-value {pval:.2e})"
    bonus = nxt[acc == 1]  # after an acceptance, the bonus token is drawn from the next row's p
    if len(bonus) > 500:
        pval = chi2_pvalue(np.bincount(bonus, minlength=V), p1)
        assert pval > 1e-3, f"bonus token not ~ p (q={qname}, p-value {pval:.2e})"
    rate = acc.mean()  # acceptance probability of x1 is sum_v min(p, q)
    assert abs(rate - np.minimum(p0, QS[qname]).sum()) < 4 * math.sqrt(0.25 / n) + 1e-9


def test_chi_square_detects_a_wrong_correction():
    """Negative control: resampling from p (instead of the residual) after a rejection is biased, and
    the test above would see it."""
    n = 20000
    x, acc, _ = _simulate(QS["reversed"], 1.0, n, seed=7)
    rng = np.random.default_rng(8)
    p0 = _p(L0, 1.0)
    wrong = np.minimum((np.cumsum(p0)[None, :] <= rng.random((n, 1))).sum(1), V - 1)
    first = np.where(acc >= 1, x, wrong)
    assert chi2_pvalue(np.bincount(first, minlength=V), p0) < 1e-6


def test_random_accept_batch_layout():
    b = ref.random_accept_batch(np.random.default_rng(0), [2, 0, 3], 11, temperature=[0.0, 1.0, 2.0])
    m = 2 + 1 + 0 + 1 + 3 + 1
    assert b["logits"].shape == (m, 11) and b["draft_probs"].shape == (m, 11)
    assert b["draft_tokens"].shape == (m,) and b["accept_uniforms"].shape == (m,)
    assert b["temperature"].tolist() == [0.0, 1.0, 2.0] and b["sample_uniforms"].shape == (3,)
    np.testing.assert_allclose(b["draft_probs"].sum(1), 1.0, rtol=1e-5)
    assert ref.request_offsets(b["verify_lens"], m).tolist() == [0, 3, 4]
