"""The price of a switch of graphs, learned from the calls that pay it (runtime/costs/switch.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from dspark_trt.runtime.config import GenerationConfig, parse_spec
from dspark_trt.runtime.costs.step import Costs
from dspark_trt.runtime.costs.switch import SwitchPrice
from dspark_trt.runtime.metrics import Metrics
from dspark_trt.runtime.phases.drafter import DraftRound
from dspark_trt.runtime.phases.verifier import Verifier
from dspark_trt.runtime.request import Request
from dspark_trt.runtime.tuning import RuntimeTuning


def stretch(price: SwitchPrice, into_verify, into_plain, plain_ms=2.0, synced_ms=0.0, trusted=True):
    """One stretch of drafting between plain calls: a switch into verifying whose calls took into_verify
    plain calls beyond the model each, then one back into plain decoding alike (the copy's sync on its first)."""
    for i, x in enumerate(into_verify):
        price.observe(i, False, trusted, x * plain_ms, 0.0, plain_ms)
    for i, x in enumerate(into_plain):
        price.observe(i, True, trusted, x * plain_ms, synced_ms if i == 0 else 0.0, plain_ms)


def test_a_stretch_is_priced_at_what_the_calls_after_both_its_switches_took_beyond_the_model():
    # ONNX Runtime at 4 rows: the verify graph's first call ~1.3x, the decoding graph's next four 1.9, 1.5,
    # 1.3, 1.15x, and 0.2 plain calls syncing the decoding graph's cache copy.
    price = SwitchPrice(prior_calls=0.0, settle_calls=4)
    for _ in range(100):
        stretch(price, [0.3], [0.9, 0.5, 0.3, 0.15], synced_ms=0.4)
    assert price.calls == pytest.approx(0.3 + 0.9 + 0.5 + 0.3 + 0.15 + 0.2, rel=1e-3)
    assert price.switches == 200


def test_where_switches_cost_nothing_the_price_falls_from_its_prior_to_nothing():
    price = SwitchPrice(prior_calls=2.5, settle_calls=4)
    assert price.calls == 2.5  # nothing seen yet: the prior
    stretch(price, [0.0], [0.0] * 4)
    assert 0.0 < price.calls < 2.5  # the prior weighs as a few switches, not as the truth
    for _ in range(60):
        stretch(price, [0.0, 0.0], [0.0] * 4)
    assert price.calls < 0.01


def test_calls_after_the_graph_settled_are_not_part_of_the_switch():
    price = SwitchPrice(prior_calls=0.0, settle_calls=2)
    for _ in range(50):
        stretch(price, [0.5, 0.5, 3.0, 3.0], [1.0, 1.0, 3.0, 3.0])  # the third call on: settled, dearer by other causes
    assert price.calls == pytest.approx(3.0, rel=0.01)


def test_calls_the_model_cannot_price_teach_nothing():
    # A prompt chunk in the call, a switch after a prompt chunk's call, or a kind not yet observed at the width.
    price = SwitchPrice(prior_calls=2.5, settle_calls=4)
    for _ in range(30):
        stretch(price, [5.0], [5.0] * 4, trusted=False)
    assert price.calls == 2.5 and price.switches == 0


def test_a_stalled_call_is_not_a_switchs_price_and_noise_goes_both_ways():
    price = SwitchPrice(prior_calls=2.0, settle_calls=4)
    stretch(price, [500.0], [1.0, 0.0, 0.0, 0.0])  # a 1 s stall on a 2 ms call
    assert price.calls < 2.0 + SwitchPrice.MAX_UNITS / (1 + SwitchPrice.PRIOR_WEIGHT)
    calm = SwitchPrice(prior_calls=0.0, settle_calls=4)
    rng = np.random.default_rng(0)
    for _ in range(400):  # switches that cost 1 plain call each way, timed with noise of +-0.5 a call
        stretch(calm, 1.0 / 4 + rng.uniform(-0.5, 0.5, 4), 1.0 / 4 + rng.uniform(-0.5, 0.5, 4))
    assert calm.calls == pytest.approx(2.0, abs=0.3)


def test_the_verifier_feeds_each_switch_of_graphs_what_its_calls_took_beyond_the_model():
    """The backend runs two graphs; a call soon after the other graph ran takes 8 ms more than the model's 2 ms
    (the first one only). The verifier sees which graph ran and times the calls: the price follows."""
    kv = SimpleNamespace(past=lambda n: [], write=lambda *a: None)
    model_ms = 2.0

    class Backend:
        last_graph = None

        def run_target(self, feeds, past):
            graph = "decode" if (feeds["query_lens"] == 1).all() else "packed"
            time.sleep((model_ms + (8.0 if graph != self.last_graph else 0.0)) / 1e3)
            self.last_graph = graph
            n = len(feeds["slot_ids"])
            return {"accepted": np.zeros(n, np.int64), "next_token": np.full(n, 7, np.int64)}, []

    costs = Costs(64, 4)
    shape = SimpleNamespace(ms=lambda *a, **k: model_ms, observed=lambda rows, plain: True, observe=lambda *a, **k: None)
    costs.table = SimpleNamespace(call_shape=shape, observe_verify=lambda *a: None)
    costs.switch = SwitchPrice(prior_calls=0.0, settle_calls=2)
    verifier = Verifier(Backend(), kv, RuntimeTuning(), (97, 64, 64), costs, Metrics(4))
    rows = [Request(i, [1, 2, 3], GenerationConfig(spec="fixed:1"), parse_spec("fixed:1", 4), 4) for i in range(2)]
    for i, r in enumerate(rows):
        r.slot, r.target_len = i, 3
    batch = SimpleNamespace(decode=rows, prefill=[])
    drafts = {r.id: SimpleNamespace(tokens=[9], probs=np.ones((1, 97), np.float32)) for r in rows}
    for _ in range(30):
        for depth in (1, 1, 0, 0, 0):  # two verify steps, three plain ones
            verifier.run(batch, DraftRound(drafts, 0.0, 0.0, 0.0), SimpleNamespace(lengths={r.id: depth for r in rows}))
    # 4 plain calls of excess a switch, two switches a stretch (30 / 34 of it past the prior of none); timing
    # overheads add a little on top
    assert costs.switch.switches >= 50
    assert 6.0 < costs.switch.calls < 12.0
