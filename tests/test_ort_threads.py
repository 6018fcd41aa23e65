"""ONNX Runtime's threads spin within a run when the cores were idle at load (DSPARK_ORT_SPIN=auto), and
never when told not to."""

from __future__ import annotations

import pytest

from dspark_trt.errors import DsparkError
from dspark_trt.runtime.backends import cpu_load
from dspark_trt.runtime.backends.ort import SPIN_IDLE_BELOW, spin_decision


def test_auto_spins_only_on_idle_cores(monkeypatch):
    monkeypatch.delenv("DSPARK_ORT_SPIN", raising=False)
    assert spin_decision(lambda: 0.03) == (True, "auto: cores 3% busy at load")
    spinning, why = spin_decision(lambda: 0.5)  # `yes` on one of two cores
    assert not spinning and "50% busy" in why
    assert not spin_decision(lambda: SPIN_IDLE_BELOW)[0]
    assert spin_decision(lambda: None) == (False, "auto: the machine's load is unknown here")


def test_the_environment_overrides_the_probe(monkeypatch):
    def never():
        raise AssertionError("an explicit setting must not probe the machine")

    monkeypatch.setenv("DSPARK_ORT_SPIN", "1")
    assert spin_decision(never) == (True, "DSPARK_ORT_SPIN=1")
    monkeypatch.setenv("DSPARK_ORT_SPIN", "0")
    assert spin_decision(never) == (False, "DSPARK_ORT_SPIN=0")
    monkeypatch.setenv("DSPARK_ORT_SPIN", "fast")
    with pytest.raises(DsparkError, match="DSPARK_ORT_SPIN='fast': use auto"):
        spin_decision(never)


def test_busy_share_from_proc_stat_lines():
    # user nice system idle iowait irq softirq steal guest guest_nice: idle and iowait are idle time
    assert cpu_load.parse_cpu_line("cpu  100 0 50 800 50 0 0 0 0 0") == (150, 1000)
    assert cpu_load.parse_cpu_line("cpu  10 0 5 85") == (15, 100)  # old kernels: four fields


def test_the_probe_reads_this_machine_once_in_a_while(monkeypatch):
    monkeypatch.setattr(cpu_load, "_last", None)
    busy = cpu_load.busy_fraction(0.02)
    assert busy is None or 0.0 <= busy <= 1.0
    monkeypatch.setattr(cpu_load, "_proc_stat", lambda: pytest.fail("probed again within REUSE_S"))
    assert cpu_load.busy_fraction(0.02) == busy


@pytest.mark.parametrize("setting", ["0", "1"])
def test_sessions_carry_the_decision(tiny_artifact, monkeypatch, setting):
    from dspark_trt.runtime.backends.ort import OrtBackend
    from dspark_trt.manifest import load_manifest

    monkeypatch.setenv("DSPARK_ORT_SPIN", setting)
    be = OrtBackend(tiny_artifact, load_manifest(tiny_artifact))
    assert be.spinning is (setting == "1") and be.spin_reason == f"DSPARK_ORT_SPIN={setting}"
    for sess in be.sessions.values():
        opts = sess.get_session_options()
        assert opts.get_session_config_entry("session.intra_op.allow_spinning") == setting
        if setting == "1":  # spinning stops at the end of each run, so draft and target never both spin
            assert opts.get_session_config_entry("session.force_spinning_stop") == "1"


def test_each_thread_regime_keeps_its_own_cost_profile(tiny_artifact, tmp_path, monkeypatch):
    """Spinning threads time small calls far faster than sleeping ones: a profile of one regime would mislead
    the other (a sleeping-thread profile priced draft calls 3x too dear for spinning threads)."""
    import shutil

    import numpy as np

    from dspark_trt.runtime import Runtime
    from dspark_trt.runtime.costs import profiling
    from dspark_trt.runtime.costs.table import CostTable

    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    for old in art.glob("cost_profile*.json"):
        old.unlink()
    measured = []

    def fake_profile(rt, **kw):
        measured.append(rt.profile_name)
        meta = dict(profiling.profile_meta(rt.manifest, rt.profile_name), spread=0.05)
        return CostTable(np.arange(rt.max_tokens_per_step + 1.0), np.arange(rt.slots_total + 1.0) * 0.1, meta)

    monkeypatch.setattr(profiling, "quick_or_full_profile", fake_profile)
    for setting, name in (("1", "ort.spin"), ("0", "ort"), ("1", "ort.spin")):
        monkeypatch.setenv("DSPARK_ORT_SPIN", setting)
        Runtime.load(art).close()
        assert profiling.profile_path(art, name).is_file()
    assert measured == ["ort.spin", "ort"]  # the third load found the spinning profile
    assert sorted(p.name for p in art.glob("cost_profile*.json")) == ["cost_profile.json", "cost_profile.ort.spin.json"]
