"""MarkovDraft (the DSpark sequential stage): numpy reference == ONNX function body on ORT, and the
reference agrees with the torch draft module's own loop; with qmax_confidence too."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

from dspark_trt.errors import DsparkError  # noqa: E402
from dspark_trt.plugins import reference as ref  # noqa: E402
from dspark_trt.plugins.onnx_functions import attach_functions  # noqa: E402
from dspark_trt.plugins.spec import OPS, make_node  # noqa: E402

CASES = ref.markov_cases(seed=0)
ATTRS = ("steps", "logit_scale", "draft_topk", "qmax_confidence")


def markov_model(steps: int, float_type=TensorProto.FLOAT, op_name="MarkovDraft", **attrs):
    op = OPS[op_name]
    types = {"anchor": TensorProto.INT64, "d2t": TensorProto.INT64, "base_logits": float_type,
             "conf_base": float_type}
    inputs = [helper.make_tensor_value_info(t.name, types.get(t.name, TensorProto.FLOAT), list(t.shape))
              for t in op.inputs]
    outputs = [helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["R", "N"]),
               helper.make_tensor_value_info("confidence_logits", TensorProto.FLOAT, ["R", "N"])]
    if op_name == "MarkovSample":
        outputs.append(helper.make_tensor_value_info("draft_probs", TensorProto.FLOAT, ["R", "N", "T"]))
    node = make_node(op_name, op.input_names, op.output_names, name="markov", steps=steps, **attrs)
    model = helper.make_model(helper.make_graph([node], "markov", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 18)])
    return attach_functions(model)


def run_onnx(case: dict, float_type=TensorProto.FLOAT, op_name="MarkovDraft"):
    model = markov_model(case["steps"], float_type, op_name, logit_scale=case["logit_scale"],
                         draft_topk=case["draft_topk"], qmax_confidence=case.get("qmax_confidence", 0))
    onnx.checker.check_model(model, full_check=True)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    feeds = {k: np.asarray(v) for k, v in case.items() if k not in ATTRS}
    if float_type == TensorProto.FLOAT16:
        feeds["base_logits"] = feeds["base_logits"].astype(np.float16)
        feeds["conf_base"] = feeds["conf_base"].astype(np.float16)
    return sess.run(None, feeds)


@pytest.mark.parametrize("qmax", [0, 1])
@pytest.mark.parametrize("name", list(CASES))
def test_onnx_body_on_ort_equals_the_reference(name, qmax):
    case = dict(CASES[name], qmax_confidence=qmax)
    tokens, conf = run_onnx(case)
    exp_tokens, exp_conf = ref.markov_draft(**case)
    assert tokens.dtype == np.int64 and tokens.shape == exp_tokens.shape
    np.testing.assert_array_equal(tokens, exp_tokens)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)


def test_float16_inputs_are_converted_first():
    case = dict(CASES["dense"])
    half = {**case, "base_logits": case["base_logits"].astype(np.float16), "conf_base": case["conf_base"].astype(np.float16)}
    tokens, conf = run_onnx(case, TensorProto.FLOAT16)
    exp_tokens, exp_conf = ref.markov_draft(**half)
    np.testing.assert_array_equal(tokens, exp_tokens)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)


def test_reference_semantics_ties_topk_and_d2t():
    z = CASES["zero_rank_weights"]
    tokens, _ = ref.markov_draft(**z)
    assert (tokens == 5).all()  # a four-way tie at indices 5..8 resolves to the lowest index
    t = CASES["topk"]
    assert ref.topk_mask(t["base_logits"][0, 0], 3).nonzero()[0].tolist() == [2, 7, 11]
    r = CASES["reduced_vocab"]
    tokens, _ = ref.markov_draft(**r)
    allowed = set((np.arange(40) + r["d2t"]).tolist())
    assert set(tokens.ravel().tolist()) <= allowed and max(allowed) >= 40  # target ids, not draft ids
    with pytest.raises(ValueError, match=r"\[R, 4, V\]"):
        ref.markov_draft(**{**CASES["dense"], "steps": 4, "base_logits": CASES["dense"]["base_logits"][:, :2]})


def test_reference_matches_the_torch_module_loop(tmp_path):
    torch = pytest.importorskip("torch")
    from dspark_trt.models.dspark_drafter import load_dspark_drafter
    from tests.dspark_fixtures import make_draft, make_target

    target_dir = make_target(tmp_path)
    variants = {"dense": {}, "topk-d2t": dict(topk=6, draft_vocab=60, logit_scale=0.8),
                "head-less": dict(head=False, head_tensors=False),
                "head-less topk-d2t": dict(head=False, head_tensors=False, topk=6, draft_vocab=60, logit_scale=0.8)}
    for name, kw in variants.items():
        drafter = load_dspark_drafter(make_draft(tmp_path, name=name, seed=2, **kw), target_dir)
        assert drafter.qmax_confidence == name.startswith("head-less")
        rng = np.random.default_rng(1)
        base = torch.from_numpy((rng.standard_normal((3, 4, drafter.cfg.draft_vocab_size)) * 2).astype(np.float32))
        cb = torch.from_numpy(rng.standard_normal((3, 4)).astype(np.float32))
        anchor = torch.tensor([3, 50, 119])
        toks, conf = drafter.markov(base, cb, anchor)
        exp_toks, exp_conf = ref.markov_draft(
            base.numpy(), cb.numpy(), anchor.numpy(), drafter.markov_head.markov_w1.weight.detach().numpy(),
            drafter.markov_head.markov_w2.weight.detach().numpy(), drafter.confidence_markov_weight().detach().numpy(),
            drafter.d2t.numpy(), steps=4, logit_scale=drafter.cfg.logit_scale, draft_topk=drafter.cfg.draft_topk or 0,
            qmax_confidence=int(drafter.qmax_confidence))
        np.testing.assert_array_equal(toks.numpy(), exp_toks)
        np.testing.assert_allclose(conf.detach().numpy(), exp_conf, rtol=1e-5, atol=1e-5)


def _logit(p):
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p) - np.log1p(-p)


@pytest.mark.parametrize("name", ["dense", "topk", "topk_reduced_scaled", "non_finite"])
def test_qmax_confidence_is_the_draft_distributions_max_probability(name):
    """qmax_confidence = 1: the confidence logit is logit(q_max) of each position's final draft
    distribution, recomputed here from the logits the loop builds (softmax over the top-k candidates; at
    the request's temperature, T <= 0 rows at 1); for greedy drafts that is the drafted token's own
    probability. Tokens and draft_probs are those of qmax_confidence = 0."""
    case = SAMPLE_CASES[name]
    plain = {k: v for k, v in case.items() if k not in ("temperature", "uniforms")}
    tokens, conf = ref.markov_draft(**plain, qmax_confidence=1)
    s_tokens, s_conf, s_probs = ref.markov_sample(**case, qmax_confidence=1)
    np.testing.assert_array_equal(tokens, ref.markov_draft(**plain)[0])
    for got, exp in zip((s_tokens, s_probs), ref.markov_sample(**case)[::2]):
        np.testing.assert_array_equal(got, exp)
    w1, w2 = case["markov_w1"], case["markov_w2"]
    mask = ref.topk_mask(case["base_logits"], case["draft_topk"])
    to_draft = {int(t): d for d, t in enumerate(np.arange(len(case["d2t"])) + case["d2t"])}
    for toks, c, temps in ((tokens, conf, np.zeros(len(tokens))), (s_tokens, s_conf, case["temperature"])):
        prev = case["anchor"]
        for i in range(case["steps"]):
            x = np.where(mask[:, i], case["base_logits"][:, i] + case["logit_scale"] * (w1[prev] @ w2.T), -np.inf)
            for r, t in enumerate(temps):
                z = x[r].astype(np.float64) / (t if t > 0 else 1.0)
                q = np.exp(z - z.max()) / np.exp(z - z.max()).sum() if np.isfinite(z.max()) else np.ones(1)
                if t <= 0 and np.isfinite(z.max()):
                    assert q[to_draft[int(toks[r, i])]] == q.max()  # greedy: the drafted token's probability
                assert abs(c[r, i] - _logit(q.max())) <= 1e-3 * max(1.0, abs(_logit(q.max()))), (r, i)
            prev = toks[:, i]
    assert np.unique(conf).size > 1 and np.unique(s_conf).size > 1
    greedy = case["temperature"] <= 0  # a greedy row scores the same in a sampled batch
    np.testing.assert_allclose(s_conf[greedy], conf[greedy], rtol=1e-6, atol=1e-6)


def test_sampled_qmax_confidence_does_not_depend_on_the_token_it_scores():
    """Lossless sampling: c_i is a function of the tokens before position i, never of the draw at i (the
    runtime decides "verify t_i?" from c_i)."""
    case = dict(SAMPLE_CASES["dense"], qmax_confidence=1)
    tokens, conf, _ = ref.markov_sample(**case)
    for i in range(case["steps"]):
        u = case["uniforms"].copy()
        u[:, i] = 1 - u[:, i]
        other, other_conf, _ = ref.markov_sample(**dict(case, uniforms=u))
        np.testing.assert_array_equal(other_conf[:, :i + 1], conf[:, :i + 1])
        assert (other[:, i] != tokens[:, i]).any()  # the draw at i did change


def test_attach_refuses_mixed_steps():
    model = markov_model(3)
    op = OPS["MarkovDraft"]
    model.graph.node.append(make_node("MarkovDraft", op.input_names, ["t2", "c2"], name="second", steps=4))
    with pytest.raises(DsparkError, match="same steps"):
        attach_functions(model)
    with pytest.raises(ValueError, match="steps must be an integer >= 1"):
        make_node("MarkovDraft", op.input_names, op.output_names, steps=0)
    with pytest.raises(ValueError, match="qmax_confidence must be 0 or 1"):
        make_node("MarkovDraft", op.input_names, op.output_names, steps=3, qmax_confidence=2)
    model = markov_model(3)
    model.graph.node.append(make_node("MarkovDraft", op.input_names, ["t2", "c2"], name="second", steps=3,
                                      qmax_confidence=1))
    with pytest.raises(DsparkError, match="same qmax_confidence"):
        attach_functions(model)


SAMPLE_CASES = ref.markov_sample_cases(seed=0)


@pytest.mark.parametrize("qmax", [0, 1])
@pytest.mark.parametrize("name", list(SAMPLE_CASES))
def test_sampling_body_on_ort_equals_the_reference(name, qmax):
    case = dict(SAMPLE_CASES[name], qmax_confidence=qmax)
    tokens, conf, probs = run_onnx(case, op_name="MarkovSample")
    exp_tokens, exp_conf, exp_probs = ref.markov_sample(**case)
    np.testing.assert_array_equal(tokens, exp_tokens)
    np.testing.assert_allclose(conf, exp_conf, rtol=1e-5, atol=1e-5)
    assert probs.shape == exp_probs.shape == (*tokens.shape, case["markov_w1"].shape[0])
    np.testing.assert_allclose(probs, exp_probs, rtol=1e-5, atol=1e-6)


def test_sampling_reference_semantics():
    case = SAMPLE_CASES["reduced_vocab"]
    tokens, _, probs = ref.markov_sample(**case)
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
    outside = np.ones(probs.shape[-1], bool)
    outside[np.arange(40) + case["d2t"]] = False
    assert (probs[..., outside] == 0).all()  # q lives on the draft vocabulary's target ids
    r, n = tokens.shape
    assert all(probs[i, j, tokens[i, j]] > 0 for i in range(r) for j in range(n))
    greedy = dict(case, temperature=np.zeros(r, np.float32))  # T <= 0: MarkovDraft's tokens, one-hot q
    g_tokens, g_conf, g_probs = ref.markov_sample(**greedy)
    d_tokens, d_conf = ref.markov_draft(**{k: v for k, v in case.items() if k not in ("temperature", "uniforms")})
    np.testing.assert_array_equal(g_tokens, d_tokens)
    assert ((g_probs == 1) | (g_probs == 0)).all() and (g_probs.sum(-1) == 1).all()
    topk = SAMPLE_CASES["topk_reduced_scaled"]
    _, _, tp = ref.markov_sample(**topk)
    assert ((tp > 0).sum(-1) <= 7).all()  # only the top-k candidates can be drawn


def test_draws_follow_q():
    """Over many uniforms the first position's draws match q (chi-square-free check: each token's share
    within 0.02 of its probability)."""
    case = dict(SAMPLE_CASES["dense"])
    r = 1
    case = {k: (v[:r] if isinstance(v, np.ndarray) and v.ndim >= 1 and v.shape[0] == 3 else v) for k, v in case.items()}
    case["temperature"] = np.array([1.0], np.float32)
    rng = np.random.default_rng(7)
    counts = np.zeros(50)
    for _ in range(2000):
        case["uniforms"] = rng.random((r, case["steps"])).astype(np.float32)
        t, _, p = ref.markov_sample(**case)
        counts[t[0, 0]] += 1
    np.testing.assert_allclose(counts / 2000, p[0, 0], atol=0.03)
