"""Adaptive speculative sampling preserves the target's distribution (statistical, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from dspark_trt.runtime import GenerationConfig, Runtime
from dspark_trt.runtime.costs.table import CostTable

N_SAMPLES = 2400
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def far_pair(tmp_path_factory):
    """A draft far from its target, so that rejections and residual sampling really happen."""
    from conftest import make_pair

    return make_pair(tmp_path_factory.mktemp("far"), seed=5, noise=0.3)


def exact_second_token_marginal(target_dir, prompt_ids, temperature):
    """p(x2) = sum_x1 p(x1 | prompt) p(x2 | prompt, x1) under the target, computed exactly."""
    import torch

    from dspark_trt.models.checkpoint import load_decoder

    model = load_decoder(target_dir)
    with torch.no_grad():
        p1 = torch.softmax(model.forward_dense(torch.tensor([prompt_ids]))[0, -1] / temperature, -1)
        v = p1.shape[0]
        seqs = torch.cat([torch.tensor(prompt_ids).repeat(v, 1), torch.arange(v)[:, None]], 1)
        p2 = torch.softmax(model.forward_dense(seqs)[:, -1] / temperature, -1)
    return (p1[:, None] * p2).sum(0).double().numpy()


def chi_square_pvalue(counts, probs, min_expected=5.0):
    from scipy.stats import chi2

    n = counts.sum()
    exp = probs * n
    big = exp >= min_expected
    obs_b, exp_b = list(counts[big]), list(exp[big])
    obs_b.append(counts[~big].sum())
    exp_b.append(exp[~big].sum())
    obs_b, exp_b = np.array(obs_b, float), np.array(exp_b, float)
    keep = exp_b > 0
    stat = ((obs_b[keep] - exp_b[keep]) ** 2 / exp_b[keep]).sum()
    return 1 - chi2.cdf(stat, keep.sum() - 1), keep.sum()


def speculate_cheaply(rt) -> None:
    """Verified tokens and draft calls almost free next to a step's fixed cost (which dwarfs the runtime's
    measured extra overhead of drafting steps): the solver admits drafts, so the acceptance/residual
    path is exercised. Drift correction off, or the table would follow the real calls (a few ms) down
    to a quarter of it, where a loaded machine's overhead of drafting steps (up to ~40 ms measured)
    makes the planner stop drafting, as it should on real costs."""
    rt.cost = CostTable(np.r_[0.0, 1000.0 + 0.001 * np.arange(200)], np.linspace(0, 0.01, 17), bounds=(1.0, 1.0))


def assert_second_token_follows_the_target(rt, target_dir, prompt, spec) -> None:
    cfgs = [GenerationConfig(max_new_tokens=4, temperature=TEMPERATURE, spec=spec, seed=s,
                             stop_at_eos=False) for s in range(N_SAMPLES)]
    outs = rt.generate([prompt] * N_SAMPLES, cfgs)
    snap = rt.metrics.snapshot()
    rt.close()
    verified, accepted = sum(snap["verified_per_position"]), sum(snap["accepted_per_position"])
    assert verified > 0.9 * N_SAMPLES and 0.05 * verified < accepted < 0.9 * verified  # speculated, with rejections
    second = np.array([o.token_ids[1] for o in outs])
    probs = exact_second_token_marginal(target_dir, prompt, TEMPERATURE)
    counts = np.bincount(second, minlength=len(probs))
    p, bins = chi_square_pvalue(counts, probs)
    assert bins >= 5
    assert p > 1e-3, f"second-token distribution differs from the target's (p={p:.2e})"


@pytest.mark.parametrize("spec", ["adaptive", "fixed:3"])
def test_speculative_sampling_matches_target_distribution(far_pair, spec):
    target, draft = far_pair
    rt = Runtime.from_checkpoints(target, draft, max_draft=3, max_batch=16, max_context=128)
    speculate_cheaply(rt)
    assert_second_token_follows_the_target(rt, target, rt.tokenizer.encode("def fib(n):"), spec)


@pytest.mark.parametrize("variant, spec", [("full", "adaptive"),
                                           pytest.param("full", "fixed:3", marks=pytest.mark.slow),
                                           pytest.param("reduced-headless", "adaptive", marks=pytest.mark.slow)])
def test_dspark_drafter_sampling_matches_target_distribution(tmp_path_factory, variant, spec):
    """The same check with a DSpark drafter on ORT: drafts and q from the sampling graph (MarkovSample,
    q in the target vocabulary), fed to SampleAccept like the classic drafter's; head-less, adaptive
    sizes verification on the q_max confidences."""
    pytest.importorskip("onnxruntime")
    from dspark_trt.manifest import load_manifest
    from tests.dspark_fixtures import ARTIFACT_VARIANTS, cached_artifact

    art = cached_artifact(tmp_path_factory, variant, **ARTIFACT_VARIANTS[variant])
    rt = Runtime.load(art, profile="none")
    speculate_cheaply(rt)
    assert_second_token_follows_the_target(rt, load_manifest(art)["sources"]["target"], [3, 17, 42, 8, 99], spec)


def test_the_check_detects_a_biased_sampler(far_pair):
    """Negative control: samples from the *draft* (what a wrong acceptance rule drifts to) fail the test."""
    target, draft = far_pair
    rt = Runtime.from_checkpoints(draft, draft, max_draft=3, max_batch=16, max_context=128)
    prompt = rt.tokenizer.encode("def fib(n):")
    cfgs = [GenerationConfig(max_new_tokens=2, temperature=TEMPERATURE, spec="off", seed=s,
                             stop_at_eos=False) for s in range(N_SAMPLES)]
    outs = rt.generate([prompt] * N_SAMPLES, cfgs)
    rt.close()
    counts = np.bincount([o.token_ids[1] for o in outs], minlength=300)
    probs = exact_second_token_marginal(target, prompt, TEMPERATURE)
    p, _ = chi_square_pvalue(counts[:len(probs)], probs)
    assert p < 1e-3
