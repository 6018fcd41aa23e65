"""Rollouts and confidence-head training on a tiny random draft/target pair (seconds, CPU, 1 thread)."""

import json
import random

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from dspark_trt.cli import cli
from dspark_trt.errors import DsparkError
from dspark_trt.models.checkpoint import load_decoder, save_decoder
from dspark_trt.models.config import ModelConfig
from dspark_trt.models.confidence_head import HEAD_CONFIG, HEAD_WEIGHTS, ConfidenceHead, load_head
from dspark_trt.models.decoder import Decoder
from dspark_trt.training import head_training
from dspark_trt.training.head_training import fit_head, fold_standardization, head_logits, train_head
from dspark_trt.training.metrics import auroc
from dspark_trt.training.rollout import eos_token_id, load_tokenizer, rollout, tokenize_texts

V = 48


def make_pair(root, seed=0, vocab=V):
    """Target (2 layers) and a draft sharing its first layer with a perturbed lm_head: partial agreement."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(40)]
    tok = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(words)}},
                                     unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    t = Decoder(ModelConfig("llama", V, 32, 64, 2, 4, 2, 8, max_position_embeddings=256)).init_weights(0.3, seed)
    d = Decoder(ModelConfig("llama", vocab, 32, 64, 1, 4, 2, 8, max_position_embeddings=256)).init_weights(0.3, seed)
    with torch.no_grad():
        d.model.layers[0].load_state_dict(t.model.layers[0].state_dict())
        if vocab == V:
            d.model.embed_tokens.weight.copy_(t.model.embed_tokens.weight)
            g = torch.Generator().manual_seed(seed + 7)
            d.lm_head.weight.copy_(t.lm_head.weight + 0.15 * torch.randn(t.lm_head.weight.shape, generator=g))
    for name, m in (("target", t), ("draft", d)):
        save_decoder(m, root / name)
        tok.save(str(root / name / "tokenizer.json"))
    rnd = random.Random(seed)
    (root / "data").mkdir(exist_ok=True)
    for i in range(3):
        (root / "data" / f"doc{i}.txt").write_text(" ".join(rnd.choice(words[:12 + 8 * i]) for _ in range(300)))
    return root


@pytest.fixture(autouse=True)
def one_thread():
    # The tiny models are latency-bound; a second thread only adds contention on a busy machine.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return make_pair(tmp_path_factory.mktemp("pair"))


@pytest.fixture
def small_defaults(monkeypatch):
    monkeypatch.setattr(head_training, "DEFAULT_CONTEXTS", 96)
    monkeypatch.setattr(head_training, "DEFAULT_CONTEXT_LEN", 24)


def _stream(pair):
    tok = load_tokenizer(pair / "draft")
    texts = [p.read_text() for p in sorted((pair / "data").glob("*.txt"))]
    return tokenize_texts(tok, texts, eos_token_id(tok, pair / "draft"))


def test_rollout_matches_definitions(pair):
    target, draft = load_decoder(pair / "target"), load_decoder(pair / "draft")
    stream = _stream(pair)
    assert stream[300] == 0  # documents joined by <|endoftext|>
    k = 4
    ro = rollout(target, draft, stream, num_contexts=20, max_draft=k, context_len=16, batch_size=8, seed=3,
                 progress=False)
    assert ro.hidden.shape == (20, k, 32) and ro.prev_token.shape == (20, k) and ro.label_expected.shape == (20, k)
    assert ((ro.label_expected >= 0) & (ro.label_expected <= 1)).all()
    assert set(np.unique(ro.label_greedy)) <= {0.0, 1.0}
    assert np.array_equal(ro.survival_greedy, np.cumprod(ro.label_greedy, 1))
    assert np.allclose(ro.reach_weight("greedy")[:, 1:], ro.survival_greedy[:, :-1])
    # Recompute rows by hand from the definitions.
    with torch.no_grad():
        for row in (0, 13):
            c, end = int(ro.context_len[row]), int(ro.context_end[row])
            x = torch.from_numpy(stream[end - c:end])[None]
            for _ in range(k):
                x = torch.cat([x, draft.forward_dense(x)[:, -1].argmax(-1, keepdim=True)], 1)
            assert x[0, c:].tolist() == ro.draft_token[row].tolist()
            fed = x[:, :-1]
            d_logits, h = draft.forward_dense(fed, return_hidden=True)
            q = torch.softmax(d_logits[0, c - 1:], -1)
            p = torch.softmax(target.forward_dense(fed)[0, c - 1:], -1)
            assert np.allclose(h[0, c - 1:].numpy(), ro.hidden[row], atol=1e-5)
            assert ro.prev_token[row].tolist() == fed[0, c - 1:].tolist()
            assert ro.prev_token[row, 0] == stream[end - 1]
            assert np.allclose(ro.label_expected[row], torch.minimum(p, q).sum(-1).numpy(), atol=1e-5)
            assert ro.label_greedy[row].tolist() == (p.argmax(-1) == x[0, c:]).float().tolist()
            assert np.allclose(ro.fallback_conf[row], q.max(-1).values.numpy(), atol=1e-6)
            logq = torch.log_softmax(d_logits[0, c - 1:], -1)
            top2 = logq.topk(2, -1).values
            by_hand = torch.stack([logq.max(-1).values, -(logq.exp() * logq).sum(-1), top2[:, 0] - top2[:, 1]], -1)
            assert np.allclose(ro.draft_stats[row], by_hand.numpy(), atol=1e-4)
            assert np.allclose(ro.stats_for(["entropy"])[row, :, 0], by_hand[:, 1].numpy(), atol=1e-4)
    again = rollout(target, draft, stream, num_contexts=20, max_draft=k, context_len=16, batch_size=8, seed=3,
                    progress=False)
    assert np.array_equal(again.hidden, ro.hidden) and np.array_equal(again.label_expected, ro.label_expected)
    # Partial agreement: the test pair is neither trivial nor hopeless.
    assert 0.05 < ro.label_greedy[:, 0].mean() < 0.95


def test_fold_standardization_is_exact():
    torch.manual_seed(0)
    work = ConfidenceHead(16, 10, 4, 3)
    with torch.no_grad():
        work.proj.weight.normal_()
        work.proj.bias.fill_(0.3)
    mu, sigma = np.random.default_rng(0).normal(size=16), np.random.default_rng(1).uniform(0.5, 2, 16)
    h = torch.randn(50, 16)
    prev = torch.randint(0, 10, (50,))
    head = fold_standardization(work, mu, sigma)
    expect = work(((h - torch.from_numpy(mu)) / torch.from_numpy(sigma)).float(), prev)
    assert torch.allclose(head(h, prev), expect, atol=1e-4)


def test_fold_standardization_is_exact_with_draft_stats():
    torch.manual_seed(0)
    work = ConfidenceHead(16, 10, 4, 3, stats=("entropy", "log_max_prob"))
    with torch.no_grad():
        work.proj.weight.normal_()
    mu, sigma = np.random.default_rng(0).normal(size=18), np.random.default_rng(1).uniform(0.5, 2, 18)
    h, s = torch.randn(50, 16), torch.randn(50, 2)
    prev = torch.randint(0, 10, (50,))
    head = fold_standardization(work, mu, sigma)
    dense = ((torch.cat([h, s], -1) - torch.from_numpy(mu)) / torch.from_numpy(sigma)).float()
    assert torch.allclose(head(h, prev, s), work(dense[:, :16], prev, dense[:, 16:]), atol=1e-4)
    assert head.stats == ("entropy", "log_max_prob")


def test_a_head_that_reads_draft_stats_refuses_to_run_without_them():
    head = ConfidenceHead(8, 10, 2, 3, stats=("entropy",))
    with pytest.raises(DsparkError, match="entropy"):
        head(torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64))
    with pytest.raises(DsparkError, match="unknown draft statistic 'max'"):
        ConfidenceHead(8, 10, 2, 3, stats=("max",))


def test_fit_head_uses_the_draft_stats():
    """The label depends only on a draft statistic (invisible in the hidden state): a head with the stat
    ranks it, the plain head cannot."""
    rng = np.random.default_rng(0)
    n, k, h = 800, 3, 8
    hidden = rng.normal(size=(n, k, h)).astype(np.float32)
    prev = rng.integers(0, 20, size=(n, k))
    stat = rng.normal(size=(n, k, 1)).astype(np.float32)
    label = (rng.uniform(size=(n, k)) < 1 / (1 + np.exp(-3 * stat[..., 0]))).astype(np.float32)
    kw = dict(vocab_size=20, rank=2, steps=200, seed=0, lr=2e-2, progress=False)
    with_stat, _ = fit_head(hidden, prev, label, np.ones((n, k)), stats=stat, stat_names=("entropy",), **kw)
    plain, _ = fit_head(hidden, prev, label, np.ones((n, k)), **kw)
    assert auroc(head_logits(with_stat, hidden, prev, stat), label) > 0.8
    assert auroc(head_logits(plain, hidden, prev), label) < 0.6


def test_fit_head_learns_a_linear_signal():
    rng = np.random.default_rng(0)
    n, k, h = 600, 3, 8
    hidden = rng.normal(size=(n, k, h)).astype(np.float32) * 3 + 1
    prev = rng.integers(0, 20, size=(n, k))
    true = 1 / (1 + np.exp(-(2 * (hidden[..., 0] - 1) / 3 - (hidden[..., 1] - 1))))
    label = (rng.uniform(size=(n, k)) < true).astype(np.float32)
    head, stats = fit_head(hidden, prev, label, np.ones((n, k)), vocab_size=20, rank=4, steps=150, seed=0,
                           lr=2e-2, progress=False)
    z = head_logits(head, hidden, prev)
    assert auroc(z, label) > 0.8
    assert stats.val_loss < stats.val_loss_init


def test_no_prev_embed_keeps_the_table_at_zero_and_does_not_memorise_rare_tokens():
    """The previous token is pure noise over a large vocabulary (most tokens rare): a learned table
    memorises the training rows' tokens and ranks new rows worse; prev_embed=False keeps e(x_prev) and
    its weights at zero (same head form, logits independent of x_prev) and generalises better."""
    rng = np.random.default_rng(0)
    n, k, h, v = 1200, 3, 8, 3000
    hidden = rng.normal(size=(n, k, h)).astype(np.float32)
    prev = rng.integers(0, v, size=(n, k))
    label = (rng.uniform(size=(n, k)) < 1 / (1 + np.exp(-1.5 * hidden[..., 0]))).astype(np.float32)
    tr, te = slice(0, 800), slice(800, None)
    kw = dict(vocab_size=v, rank=1, steps=300, seed=0, progress=False)
    learned, _ = fit_head(hidden[tr], prev[tr], label[tr], np.ones((800, k)), **kw)
    fixed, fit = fit_head(hidden[tr], prev[tr], label[tr], np.ones((800, k)), prev_embed=False, **kw)
    assert learned.token_embed.weight.abs().max() > 0.1
    assert float(fixed.token_embed.weight.detach().abs().max()) == 0.0
    assert float(fixed.proj.weight.detach()[0, h:].abs().max()) == 0.0
    assert (fixed.hidden_size, fixed.vocab_size, fixed.rank) == (h, v, 1)
    z = head_logits(fixed, hidden[te], prev[te])
    np.testing.assert_array_equal(z, head_logits(fixed, hidden[te], np.zeros_like(prev[te])))
    assert auroc(z, label[te]) > auroc(head_logits(learned, hidden[te], prev[te]), label[te]) + 0.01
    assert fit.val_loss < fit.val_loss_init


def test_train_head_cli_no_prev_embed(pair, tmp_path, small_defaults):
    out = tmp_path / "head"
    res = CliRunner().invoke(cli, ["train-head", "--target", str(pair / "target"), "--draft", str(pair / "draft"),
                                   "--data", str(pair / "data"), "--out", str(out), "--max-draft", "3", "--steps",
                                   "30", "--rank", "1", "--labels", "greedy", "--no-prev-embed"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    meta = json.loads((out / HEAD_CONFIG).read_text())
    assert meta["training"]["prev_embed"] is False and meta["rank"] == 1
    head = load_head(out)
    assert float(head.token_embed.weight.detach().abs().max()) == 0.0


def test_train_head_cli_end_to_end_and_force(pair, tmp_path, small_defaults):
    out = tmp_path / "head"
    args = ["train-head", "--target", str(pair / "target"), "--draft", str(pair / "draft"), "--data",
            str(pair / "data"), "--out", str(out), "--max-draft", "3", "--steps", "60", "--rank", "4"]
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output + repr(res.exception)
    assert "wrote" in res.output
    assert (out / HEAD_WEIGHTS).is_file() and (out / HEAD_CONFIG).is_file()
    head = load_head(out)
    assert (head.hidden_size, head.vocab_size, head.rank, head.max_draft) == (32, V, 4, 3)
    assert head.temperatures == [1.0, 1.0, 1.0]
    meta = json.loads((out / HEAD_CONFIG).read_text())
    assert meta["training"]["labels"] == "expected" and meta["training"]["rollout"]["num_contexts"] == 96
    assert meta["training"]["prev_embed"] is True  # the default: the table is learned
    assert meta["stats"] == ["log_max_prob", "entropy", "log_margin"] == list(head.stats)  # the default
    before = (out / HEAD_WEIGHTS).read_bytes()

    res = CliRunner().invoke(cli, args)  # refuses before doing any work
    assert res.exit_code != 0
    assert isinstance(res.exception, DsparkError) and "--force" in str(res.exception)
    assert (out / HEAD_WEIGHTS).read_bytes() == before

    res = CliRunner().invoke(cli, args + ["--force", "--labels", "greedy", "--seed", "1", "--stats", "none",
                                          "--contexts", "40"])
    assert res.exit_code == 0, res.output + repr(res.exception)
    meta = json.loads((out / HEAD_CONFIG).read_text())
    assert meta["training"]["labels"] == "greedy" and meta["stats"] == [] and load_head(out).stats == ()
    assert meta["training"]["rollout"]["num_contexts"] == 40

    res = CliRunner().invoke(cli, args + ["--force", "--stats", "entropy,nope"])
    assert res.exit_code != 0 and "unknown draft statistic 'nope'" in str(res.exception)


def snapshot(d):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def test_train_head_never_writes_into_its_inputs(tmp_path, small_defaults):
    p = make_pair(tmp_path, seed=2)
    before = {name: snapshot(p / name) for name in ("target", "draft", "data")}
    with pytest.raises(DsparkError, match="pass --out DIR"):
        train_head(p / "target", p / "draft", p / "data", max_draft=2, steps=5, rank=2, progress=False)
    with pytest.raises(DsparkError, match="is the --draft directory"):
        train_head(p / "target", p / "draft", p / "data", out_dir=p / "draft", overwrite=True, max_draft=2, steps=5,
                   progress=False)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(DsparkError, match="not a confidence head"):  # a model directory, even with --force
        train_head(p / "target", p / "draft", p / "data", out_dir=tmp_path / "model", overwrite=True,
                   max_draft=2, steps=5, progress=False)
    path = train_head(p / "target", p / "draft", p / "data", out_dir=tmp_path / "head", max_draft=2, steps=5, rank=2,
                      progress=False)
    assert path == tmp_path / "head" / HEAD_WEIGHTS and (tmp_path / "head" / HEAD_CONFIG).is_file()
    assert {name: snapshot(p / name) for name in before} == before
    assert not [q.name for q in tmp_path.iterdir() if q.name.startswith(".head-")]  # no staging left behind


def test_train_head_refuses_data_too_small(pair, tmp_path):
    (tmp_path / "one.txt").write_text("def")
    with pytest.raises(DsparkError, match=r"too small to train a head on: .* hold \d+ distinct contexts .* at least 256"):
        train_head(pair / "target", pair / "draft", tmp_path / "one.txt", out_dir=tmp_path / "h", progress=False)
    assert not (tmp_path / "h").exists()


def test_head_is_deterministic_for_a_seed(pair, tmp_path, small_defaults):
    from safetensors.numpy import load_file

    kw = dict(max_draft=3, steps=40, rank=4, progress=False)
    a = train_head(pair / "target", pair / "draft", pair / "data", out_dir=tmp_path / "a", seed=5, **kw)
    b = train_head(pair / "target", pair / "draft", pair / "data", out_dir=tmp_path / "b", seed=5, **kw)
    c = train_head(pair / "target", pair / "draft", pair / "data", out_dir=tmp_path / "c", seed=6, **kw)
    ta, tb, tc = load_file(str(a)), load_file(str(b)), load_file(str(c))
    assert all(np.array_equal(ta[k], tb[k]) for k in ta)
    assert not all(np.array_equal(ta[k], tc[k]) for k in ta)


def test_vocab_mismatch_is_refused(tmp_path, small_defaults):
    p = make_pair(tmp_path, vocab=V + 8)
    with pytest.raises(DsparkError, match="vocab"):
        train_head(p / "target", p / "draft", p / "data", out_dir=tmp_path / "h", steps=5, progress=False)


def test_unknown_labels_and_missing_data(pair, tmp_path):
    with pytest.raises(DsparkError, match="labels"):
        train_head(pair / "target", pair / "draft", pair / "data", out_dir=tmp_path / "h", labels="soft")
    with pytest.raises(DsparkError, match="does not exist"):
        train_head(pair / "target", pair / "draft", tmp_path / "nope", out_dir=tmp_path / "h", progress=False)
