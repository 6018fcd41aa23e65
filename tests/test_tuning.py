"""RuntimeTuning: one frozen dataclass holds every runtime knob; docs/tuning.md is generated from it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.tuning import DriftTuning, RuntimeTuning, tuning_markdown

DOC = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"


def test_docs_tuning_md_is_generated_from_the_dataclass():
    assert DOC.read_text() == tuning_markdown(), (
        "docs/tuning.md is stale: run `python scripts/tuning_doc.py`")


def test_every_field_has_a_docstring_in_the_doc():
    text = tuning_markdown()
    for cls in (RuntimeTuning, DriftTuning):
        for f in dataclasses.fields(cls):
            row = next(line for line in text.splitlines() if line.startswith(f"| `{f.name}` |"))
            assert len(row.rsplit("|", 2)[-2].strip()) > 20, f"{f.name} has no docstring"


def test_tuning_is_frozen_and_changed_with_replace():
    t = RuntimeTuning()
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.plan_every = 3
    u = dataclasses.replace(t, plan_every=3, drift=dataclasses.replace(t.drift, catch_up=8))
    assert (u.plan_every, u.drift.catch_up, t.plan_every) == (3, 8, 8)


@pytest.mark.parametrize("change, message", [
    ({"plan_every": 0}, "plan_every"),
    ({"explore_budget": -0.1}, "explore_budget"),
    ({"rate_alpha": 1.5}, "rate_alpha"),
    ({"call_test": 1}, "call_test"),
    ({"drift": {"catch_up": -1}}, "drift.catch_up"),
    ({"drift": {"bound_high": 0.5}}, "drift.bound_high"),
])
def test_validate_names_the_field_out_of_range(change, message):
    with pytest.raises(DsparkError, match=message.replace(".", r"\.")):
        RuntimeTuning.from_dict(change)


def test_from_json_reads_a_file_or_text_with_nested_groups(tmp_path):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"plan_every": 4, "correction": {"enabled": False}}))
    t = RuntimeTuning.from_json(path)
    assert t.plan_every == 4 and t.correction.enabled is False and t.drift == DriftTuning()
    assert RuntimeTuning.from_json('{"drift": {"catch_up": 3}}').drift.catch_up == 3
    with pytest.raises(DsparkError, match="unknown tuning field drift.catch_u"):
        RuntimeTuning.from_json('{"drift": {"catch_u": 3}}')
    assert RuntimeTuning.from_dict(t.to_dict()) == t


def test_runtime_load_takes_a_tuning(tiny_artifact):
    from dspark_trt.runtime import Runtime

    t = dataclasses.replace(RuntimeTuning(), correction=dataclasses.replace(RuntimeTuning().correction, enabled=False))
    rt = Runtime.load(tiny_artifact, profile="none", tuning=t)
    try:
        assert rt.tuning is t and rt.survival_correction is None
    finally:
        rt.close()
