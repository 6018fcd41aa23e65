"""Metrics, sequential temperature scaling, and the `calibrate` command on a tiny random pair."""

import json
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dspark_trt.cli import cli
from dspark_trt.errors import DsparkError
from dspark_trt.models.checkpoint import save_decoder
from dspark_trt.models.config import ModelConfig
from dspark_trt.models.confidence_head import HEAD_CONFIG, HEAD_WEIGHTS, load_head
from dspark_trt.models.decoder import Decoder
from dspark_trt.training import calibration, head_training, metrics
from dspark_trt.training.calibration import calibrate_arrays, fit_temperatures, survival_of

# ----------------------------------------------------------------------------------------------- metrics


def test_ece_hand_computed():
    # Two equal-width bins of 15: [0.2, 0.2] -> bin 3, [0.9, 0.9] -> bin 13.
    conf = [0.2, 0.2, 0.9, 0.9]
    out = [0, 1, 1, 1]
    # bin 3: |0.2 - 0.5| = 0.3, bin 13: |0.9 - 1| = 0.1; each half the mass.
    assert metrics.ece(conf, out) == pytest.approx(0.2)
    b = metrics.reliability_bins(conf, out)
    assert b.count[3] == 2 and b.count[13] == 2 and b.count.sum() == 4
    assert np.isnan(b.mean_conf[0])
    assert metrics.ece([1.0, 0.0], [1, 0]) == 0.0  # edges land in the first and last bins
    assert metrics.ece([0.3, 0.3], [0.3, 0.3]) == pytest.approx(0.0)  # soft outcomes
    assert metrics.ece(conf, out, weights=[1, 1, 0, 0]) == pytest.approx(0.3)


def test_ece_of_a_calibrated_predictor_is_small_and_of_a_biased_one_is_not():
    rng = np.random.default_rng(0)
    conf = rng.uniform(size=200_000)
    out = rng.uniform(size=conf.size) < conf
    assert metrics.ece(conf, out) < 0.01
    assert metrics.ece(conf, out, strategy="quantile") < 0.01
    assert metrics.ece(np.clip(conf + 0.1, 0, 1), out) == pytest.approx(0.1, abs=0.02)


def test_auroc_perfect_random_inverted_and_ties():
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, size=5000)
    s = y + rng.uniform(0, 0.5, size=y.size)
    assert metrics.auroc(s, y) == 1.0
    assert metrics.auroc(-s, y) == 0.0
    assert metrics.auroc(rng.uniform(size=y.size), y) == pytest.approx(0.5, abs=0.03)
    assert metrics.auroc(np.ones(y.size), y) == 0.5  # all tied
    assert metrics.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)  # sklearn's docs example
    assert metrics.auroc([0.5, 0.5, 0.2], [1, 0, 0]) == pytest.approx(0.75)  # one tie counts 1/2
    assert np.isnan(metrics.auroc([0.1, 0.2], [1, 1]))
    with pytest.raises(ValueError):
        metrics.auroc([0.1, 0.2], [0.5, 1])


def test_brier_log_loss_and_ranks():
    assert metrics.brier([0.2, 0.9], [0, 1]) == pytest.approx((0.04 + 0.01) / 2)
    assert metrics.brier([0.5], [0.5]) == 0.0
    assert metrics.log_loss([0.5, 0.5], [0, 1]) == pytest.approx(np.log(2))
    assert metrics.rankdata([3, 1, 3, 2]).tolist() == [3.5, 1.0, 3.5, 2.0]


# ----------------------------------------------------------------------------------------------- STS


def synthetic(true_t, n=20_000, seed=0):
    """Head logits z and outcomes where position k is accepted w.p. sigmoid(z_k / T*_k) given the prefix."""
    rng = np.random.default_rng(seed)
    k = len(true_t)
    z = rng.normal(2.0, 2.0, size=(n, k))  # first position accepted ~80%, like real pairs
    p = 1 / (1 + np.exp(-z / np.asarray(true_t)))
    accepted = rng.uniform(size=(n, k)) < p
    return z, np.cumprod(accepted, 1).astype(float), p


def test_sts_recovers_known_temperatures_and_reduces_ece():
    true_t = [0.5, 2.0, 1.0, 3.0]
    z, survived, p = synthetic(true_t)
    temps = fit_temperatures(z, survived)
    assert np.allclose(temps, true_t, rtol=0.1), temps
    res = calibrate_arrays(z, survived, fallback_conf=p)
    assert res.temperatures == pytest.approx(temps.tolist())
    for row in res.positions:
        assert row["ece_after"] < 0.02
        assert row["ece_after"] <= row["ece_before"]
    assert max(r["ece_before"] for r in res.positions) > 0.05
    # The fallback here is the true conditional probability, so it is calibrated too.
    assert all(r["ece"] < 0.02 for r in res.fallback)
    assert res.summary["tau_predicted"] == pytest.approx(res.summary["tau_observed"], abs=0.05)
    s = survival_of(z, temps)
    assert (np.diff(s, axis=1) <= 1e-12).all()  # survival is non-increasing along positions
    lines = res.table_lines()
    assert lines[0].startswith("| k | T_k |") and len([x for x in lines if x.startswith("| ")]) == 1 + 4


def test_sts_is_sequential():
    # S_2 is scored with T_1 already fixed: keeping T_1 = 1 makes position 2 worse calibrated.
    z, survived, _ = synthetic([0.3, 1.5], seed=2)
    seq = fit_temperatures(z, survived)
    assert seq[0] == pytest.approx(0.3, rel=0.15) and seq[1] == pytest.approx(1.5, rel=0.15)
    wrong_first = survival_of(z, [1.0, seq[1]])
    assert metrics.ece(wrong_first[:, 1], survived[:, 1]) > metrics.ece(survival_of(z, seq)[:, 1], survived[:, 1])


def test_a_bias_temperatures_cannot_fix_is_reported():
    rng = np.random.default_rng(3)
    z = rng.normal(0.0, 0.3, size=(5000, 2))  # the head says ~0.5 everywhere ...
    survived = np.cumprod(rng.uniform(size=z.shape) < 0.15, 1).astype(float)  # ... but 15% are accepted
    res = calibrate_arrays(z, survived, fallback_conf=np.full(z.shape, 0.15))
    warnings = calibration.bias_warnings(res, head_labels="expected")
    assert len(warnings) == 1 and "--labels greedy" in warnings[0]
    z_ok, s_ok, p_ok = synthetic([1.0, 1.0])
    assert calibration.bias_warnings(calibrate_arrays(z_ok, s_ok, p_ok), head_labels="expected") == []


# ----------------------------------------------------------------------------------------------- calibrate


def make_pair(root, seed=0):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = Decoder(ModelConfig("llama", 48, 32, 64, 2, 4, 2, 8, max_position_embeddings=256)).init_weights(0.3, seed)
    d = Decoder(ModelConfig("llama", 48, 32, 64, 1, 4, 2, 8, max_position_embeddings=256)).init_weights(0.3, seed)
    with torch.no_grad():
        d.model.layers[0].load_state_dict(t.model.layers[0].state_dict())
        d.model.embed_tokens.weight.copy_(t.model.embed_tokens.weight)
        g = torch.Generator().manual_seed(seed + 7)
        d.lm_head.weight.copy_(t.lm_head.weight + 0.15 * torch.randn(t.lm_head.weight.shape, generator=g))
    for name, m in (("target", t), ("draft", d)):
        save_decoder(m, root / name)
        tok.save(str(root / name / "tokenizer.json"))
    rnd = random.Random(seed)
    for split in ("train", "heldout"):
        (root / split).mkdir(exist_ok=True)
        for i in range(3):
            (root / split / f"doc{i}.txt").write_text(" ".join(rnd.choice(words[:12 + 8 * i]) for _ in range(300)))
    return root


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = make_pair(tmp_path_factory.mktemp("calpair"))
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    head_training.train_head(root / "target", root / "draft", root / "train", out_dir=root / "head", max_draft=3,
                             steps=80, rank=4, labels="greedy", num_contexts=160, context_len=24, progress=False)
    torch.set_num_threads(n)
    return root


def snapshot(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_calibrate_cli_writes_a_new_head_report_and_pngs(trained, tmp_path, monkeypatch):
    monkeypatch.setattr(calibration, "DEFAULT_CONTEXTS", 160)
    monkeypatch.setattr(calibration, "DEFAULT_CONTEXT_LEN", 24)
    report = tmp_path / "reports" / "cal.json"
    inputs = {name: snapshot(trained / name) for name in ("target", "draft", "head", "heldout")}
    out = tmp_path / "calibrated"
    res = CliRunner().invoke(cli, ["calibrate", "--target", str(trained / "target"), "--draft",
                                   str(trained / "draft"), "--head", str(trained / "head"), "--data",
                                   str(trained / "heldout"), "--out", str(out), "--report", str(report),
                                   "--max-draft", "3"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "| k | T_k |" in res.output and "report:" in res.output and f"calibrated head: {out}" in res.output

    data = json.loads(report.read_text())
    assert set(data) == {"positions", "fallback", "summary"}
    assert [p["k"] for p in data["positions"]] == [1, 2, 3]
    for p in data["positions"]:
        assert set(p) == {"k", "temperature", "ece_before", "ece_after", "auroc", "brier", "n"}
        assert p["n"] == 160 and calibration.T_GRID_MIN <= p["temperature"] <= calibration.T_GRID_MAX
    assert data["positions"][0]["ece_after"] <= data["positions"][0]["ece_before"] + 1e-12
    assert set(data["fallback"]) == {"positions"}
    for p in data["fallback"]["positions"]:
        assert set(p) == {"k", "ece", "auroc", "brier", "n"}
    s = data["summary"]
    assert s["labels"] == "greedy" and s["binning"] == "equal-width" and s["bins"] == 15
    assert s["figures"] == ["cal_k1.png", "cal_k2.png", "cal_k3.png"]
    for k in (1, 2, 3):
        png = report.parent / f"cal_k{k}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The calibrated head is the input's weights with the new temperatures; no input changed.
    temps = [p["temperature"] for p in data["positions"]]
    assert load_head(out).temperatures == pytest.approx(temps)
    assert (out / HEAD_WEIGHTS).read_bytes() == (trained / "head" / HEAD_WEIGHTS).read_bytes()
    meta = json.loads((out / HEAD_CONFIG).read_text())
    assert "training" in meta  # calibration keeps the training record
    assert {name: snapshot(trained / name) for name in inputs} == inputs
    assert sorted(p.name for p in out.parent.iterdir()) == ["calibrated", "reports"]  # no staging left behind

    # Deterministic: the same seed gives the same temperatures (nothing written without out_dir).
    again = calibration.calibrate(trained / "target", trained / "draft", trained / "heldout",
                                  head_dir=trained / "head", max_draft=3, progress=False)
    assert again.temperatures == pytest.approx(temps) and again.head_path is None

    # An existing --out is replaced only with --force.
    args = ["calibrate", "--target", str(trained / "target"), "--draft", str(trained / "draft"), "--head",
            str(out), "--data", str(trained / "heldout"), "--out", str(out), "--max-draft", "3"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and "is the --head directory" in str(res.exception)
    args[-3] = str(tmp_path / "again")
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / HEAD_CONFIG).parent.mkdir()
    (tmp_path / "again" / HEAD_CONFIG).write_text("{}")
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 1 and "--force" in str(res.exception)
    res = CliRunner().invoke(cli, args + ["--force"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert load_head(tmp_path / "again").temperatures == pytest.approx(temps)


def test_calibrate_fewer_positions_keeps_later_temperatures(trained, tmp_path):
    from dspark_trt.models.confidence_head import save_temperatures

    head = tmp_path / "head"
    head.mkdir()
    (head / HEAD_CONFIG).parent.mkdir()
    for name in (HEAD_WEIGHTS, HEAD_CONFIG):
        (head / name).write_bytes((trained / "head" / name).read_bytes())
    save_temperatures(head, [1.0, 1.0, 7.5])
    res = calibration.calibrate(trained / "target", trained / "draft", trained / "heldout", head_dir=head,
                                max_draft=2, num_contexts=64, context_len=16, progress=False,
                                out_dir=tmp_path / "out")
    assert len(res.positions) == 2
    assert load_head(tmp_path / "out").temperatures[2] == 7.5
    assert load_head(head).temperatures == [1.0, 1.0, 7.5]  # the input head is left as it was
    with pytest.raises(DsparkError, match="max-draft"):
        calibration.calibrate(trained / "target", trained / "draft", trained / "heldout",
                              head_dir=head, max_draft=5, progress=False)


def test_calibrate_without_head_names_train_head(trained, tmp_path):
    with pytest.raises(DsparkError, match="train-head"):
        calibration.calibrate(trained / "target", trained / "draft", trained / "heldout", head_dir=tmp_path,
                              progress=False)


def test_calibrate_refuses_data_too_small_saying_how_many_contexts(trained, tmp_path):
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "one.txt").write_text("def")
    with pytest.raises(DsparkError, match=r"too small to calibrate on: .* hold \d+ distinct contexts .* at least 256"):
        calibration.calibrate(trained / "target", trained / "draft", tmp_path / "tiny", head_dir=trained / "head", max_draft=3,
                              out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_calibrate_checks_report_and_out_before_any_work(trained, tmp_path, unwritable_dir, monkeypatch):
    from dspark_trt.training import rollout

    def no_work(*a, **k):
        raise AssertionError("rolled out before checking the destinations")

    monkeypatch.setattr(rollout, "rollout_from_dirs", no_work)
    base = ["calibrate", "--target", str(trained / "target"), "--draft", str(trained / "draft"), "--head",
            str(trained / "head"), "--data", str(trained / "heldout")]
    res = CliRunner().invoke(cli, base + ["--out", str(tmp_path / "h"), "--report", str(unwritable_dir / "r.json")])
    assert res.exit_code == 1 and "--report" in str(res.exception) and "cannot be written" in str(res.exception)
    (tmp_path / "file").write_text("x")
    res = CliRunner().invoke(cli, base + ["--out", str(tmp_path / "h"), "--report", str(tmp_path / "file" / "r.json")])
    assert res.exit_code == 1 and "is a file, not a directory" in str(res.exception)
    res = CliRunner().invoke(cli, base + ["--out", str(tmp_path / "file" / "h")])
    assert res.exit_code == 1 and "--out" in str(res.exception) and "is a file" in str(res.exception)
    res = CliRunner().invoke(cli, base + ["--out", str(trained / "draft"), "--force"])
    assert res.exit_code == 1 and "is the --draft directory" in str(res.exception)
    res = CliRunner().invoke(cli, base)
    assert res.exit_code == 1 and "pass --out DIR" in str(res.exception)
    assert not (tmp_path / "h").exists()
