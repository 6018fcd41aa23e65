"""`dspark-trt calibrate`: sequential temperature scaling (STS) of the confidence head on held-out data.

The runtime's survival is S_k = prod_{i<=k} sigmoid(z_i / T_i) with z_i the head logit of draft position
i. For k = 1..K in order, with T_1..T_{k-1} already fixed, T_k is the value on a log grid
(0.05 .. 20, 200 points) that minimises the ECE of S_k against the observed prefix survival at k:
greedy by default (1 if the draft's x_1..x_k all equal the target's argmax), or, with labels="expected",
prod_{i<=k} (1 - TV_i). Among grid points within TIE_TOLERANCE of the best ECE, the temperature closest
to 1 wins (ECE is flat in T where the head carries little signal; this keeps T from drifting to a grid
end on noise).

ECE uses 15 equal-width bins (metrics.py; "quantile" gives equal-mass bins). "Before" is the raw head
(all T = 1), "after" the calibrated one. AUROC is always against the binary greedy prefix survival
(rank-based, ties count 1/2). The fallback rows score the runtime's no-head survival prod_{i<=k} max q_i.

The calibrated head (the same weights, the new temperatures in confidence_head.json) is written to a
new head directory (`--out`, head_output.py); the input head is never modified. With a report path, the
report JSON is written there and one reliability diagram per position beside it: <report stem>_k<k>.png.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dspark_trt.errors import DsparkError
from dspark_trt.training import metrics

T_GRID_MIN, T_GRID_MAX, T_GRID_POINTS = 0.05, 20.0, 200
TIE_TOLERANCE = 1e-4  # ECE differences below this are noise
DEFAULT_CONTEXTS = 2048  # held-out contexts rolled out; x max_draft positions
DEFAULT_CONTEXT_LEN = 128
MIN_CONTEXTS = 256  # distinct held-out contexts needed (15-bin ECE on fewer measures mostly noise)


def temperature_grid(lo: float = T_GRID_MIN, hi: float = T_GRID_MAX, points: int = T_GRID_POINTS) -> np.ndarray:
    """Log-spaced temperatures, plus T = 1 exactly (so an already calibrated position can stay as it is)."""
    return np.union1d(np.exp(np.linspace(math.log(lo), math.log(hi), points)), [1.0])


def sigmoid(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.float64)
    out = np.empty_like(z)
    pos = z >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-z[pos]))
    ez = np.exp(z[~pos])
    out[~pos] = ez / (1.0 + ez)
    return out


def survival_of(logits: np.ndarray, temperatures) -> np.ndarray:
    """S [N, K] = cumulative product of sigmoid(logits / T_k)."""
    t = np.asarray(temperatures, dtype=np.float64)[None, : logits.shape[1]]
    return np.cumprod(sigmoid(np.asarray(logits, dtype=np.float64) / t), axis=1)


def fit_temperatures(logits: np.ndarray, survived: np.ndarray, grid: np.ndarray | None = None,
                     n_bins: int = metrics.DEFAULT_BINS, strategy: str = "uniform") -> np.ndarray:
    """Sequential temperature scaling: logits [N, K] (head, before temperature), survived [N, K] observed
    prefix survival (0/1 or soft). Returns T [K]."""
    grid = temperature_grid() if grid is None else np.asarray(grid, dtype=np.float64)
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(survived, dtype=np.float64)
    n, k = z.shape
    temps = np.ones(k)
    prefix = np.ones(n)
    closeness = np.abs(np.log(grid))
    for j in range(k):
        eces = np.array([metrics.ece(prefix * sigmoid(z[:, j] / t), y[:, j], n_bins, strategy) for t in grid])
        best = np.nanmin(eces) if np.isfinite(eces).any() else np.nan
        if not np.isfinite(best):
            temps[j] = 1.0
        else:
            cand = np.flatnonzero(eces <= best + TIE_TOLERANCE)
            temps[j] = float(grid[cand[np.argmin(closeness[cand])]])
        prefix = prefix * sigmoid(z[:, j] / temps[j])
    return temps


def _nan_to_none(v):
    return None if isinstance(v, float) and not math.isfinite(v) else v


@dataclass
class CalibrationResult:
    temperatures: list[float]
    positions: list[dict]  # {"k", "temperature", "ece_before", "ece_after", "auroc", "brier", "n"}
    fallback: list[dict]  # {"k", "ece", "auroc", "brier", "n"}
    summary: dict
    bins: dict = field(default_factory=dict)  # per k: {"before", "after", "fallback"} ReliabilityBins
    report_path: Path | None = None
    head_path: Path | None = None  # the calibrated head directory written, if any
    figure_paths: list[Path] = field(default_factory=list)

    def to_dict(self) -> dict:
        clean = lambda rows: [{k: _nan_to_none(v) for k, v in r.items()} for r in rows]  # noqa: E731
        return {"positions": clean(self.positions), "fallback": {"positions": clean(self.fallback)},
                "summary": {k: _nan_to_none(v) for k, v in self.summary.items()}}

    def table_lines(self) -> list[str]:
        f = lambda v, d=3: "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{d}f}"  # noqa: E731
        lines = ["| k | T_k | ECE before | ECE after | AUROC | Brier | fallback ECE | fallback AUROC | n |",
                 "|---|-----|------------|-----------|-------|-------|--------------|----------------|---|"]
        for p, fb in zip(self.positions, self.fallback):
            lines.append(f"| {p['k']} | {f(p['temperature'])} | {f(p['ece_before'], 4)} | {f(p['ece_after'], 4)} | "
                         f"{f(p['auroc'])} | {f(p['brier'], 4)} | {f(fb['ece'], 4)} | {f(fb['auroc'])} | {p['n']} |")
        s = self.summary
        lines.append("")
        lines.append(f"mean ECE {f(s.get('mean_ece_before'), 4)} -> {f(s.get('mean_ece_after'), 4)}; mean AUROC "
                     f"{f(s.get('mean_auroc'))} (fallback {f(s.get('mean_auroc_fallback'))}); tau observed "
                     f"{f(s.get('tau_observed'), 2)}, predicted {f(s.get('tau_predicted'), 2)}")
        for w in s.get("warnings") or []:
            lines.append(f"warning: {w}")
        if self.head_path is not None:
            lines.append(f"calibrated head: {self.head_path}")
        if self.report_path is not None:
            lines.append(f"report: {self.report_path}")
        return lines


def evaluate(logits: np.ndarray, temperatures, survived: np.ndarray, survived_greedy: np.ndarray,
             fallback_conf: np.ndarray, n_bins: int = metrics.DEFAULT_BINS, strategy: str = "uniform"):
    """Per-position rows of the report for given temperatures (pure numpy)."""
    k = logits.shape[1]
    before = survival_of(logits, np.ones(k))
    after = survival_of(logits, temperatures)
    fb = np.cumprod(np.asarray(fallback_conf, dtype=np.float64), axis=1)
    positions, fallback, bins = [], [], {}
    for j in range(k):
        y, yg = survived[:, j], survived_greedy[:, j]
        b_before = metrics.reliability_bins(before[:, j], y, n_bins, strategy)
        b_after = metrics.reliability_bins(after[:, j], y, n_bins, strategy)
        b_fb = metrics.reliability_bins(fb[:, j], y, n_bins, strategy)
        positions.append({"k": j + 1, "temperature": float(temperatures[j]), "ece_before": b_before.ece,
                          "ece_after": b_after.ece, "auroc": metrics.auroc(after[:, j], yg),
                          "brier": metrics.brier(after[:, j], y), "n": int(y.size)})
        fallback.append({"k": j + 1, "ece": b_fb.ece, "auroc": metrics.auroc(fb[:, j], yg),
                         "brier": metrics.brier(fb[:, j], y), "n": int(y.size)})
        bins[j + 1] = {"before": b_before, "after": b_after, "fallback": b_fb}
    return positions, fallback, bins, after, fb


def calibrate_arrays(logits: np.ndarray, survived: np.ndarray, fallback_conf: np.ndarray,
                     survived_greedy: np.ndarray | None = None, n_bins: int = metrics.DEFAULT_BINS,
                     strategy: str = "uniform", grid=None, labels: str = "greedy") -> CalibrationResult:
    """Fit and evaluate STS on precomputed arrays (all [N, K])."""
    survived = np.asarray(survived, dtype=np.float64)
    survived_greedy = survived if survived_greedy is None else np.asarray(survived_greedy, dtype=np.float64)
    temps = fit_temperatures(logits, survived, grid, n_bins, strategy)
    positions, fallback, bins, after, fb = evaluate(logits, temps, survived, survived_greedy, fallback_conf,
                                                    n_bins, strategy)
    mean = lambda rows, key: float(np.nanmean([r[key] for r in rows])) if rows and np.isfinite(  # noqa: E731
        [r[key] for r in rows]).any() else float("nan")
    summary = {
        "labels": labels, "bins": n_bins, "binning": "equal-width" if strategy == "uniform" else "equal-mass",
        "temperature_grid": [float(min(temperature_grid() if grid is None else grid)),
                             float(max(temperature_grid() if grid is None else grid)),
                             int(len(temperature_grid() if grid is None else grid))],
        "temperatures": [float(t) for t in temps], "contexts": int(logits.shape[0]), "max_draft": int(logits.shape[1]),
        "mean_ece_before": mean(positions, "ece_before"), "mean_ece_after": mean(positions, "ece_after"),
        "max_ece_after": float(np.nanmax([p["ece_after"] for p in positions])) if positions else float("nan"),
        "mean_auroc": mean(positions, "auroc"), "mean_brier": mean(positions, "brier"),
        "mean_ece_fallback": mean(fallback, "ece"), "mean_auroc_fallback": mean(fallback, "auroc"),
        "mean_brier_fallback": mean(fallback, "brier"),
        "tau_observed": float(1.0 + survived.sum(1).mean()), "tau_predicted": float(1.0 + after.sum(1).mean()),
        "tau_predicted_fallback": float(1.0 + fb.sum(1).mean()),
        "survival_observed": [float(v) for v in survived.mean(0)],
        "survival_predicted": [float(v) for v in after.mean(0)],
    }
    return CalibrationResult([float(t) for t in temps], positions, fallback, summary, bins)


def calibrate(target_dir, draft_dir, data, head_dir=None, report_path=None, max_draft: int = 7, seed: int = 0, *,
              out_dir=None, overwrite: bool = False, labels: str = "greedy", num_contexts: int | None = None,
              context_len: int | None = None, batch_size: int = 32, n_bins: int = metrics.DEFAULT_BINS,
              strategy: str = "uniform", progress: bool = True) -> CalibrationResult:
    """Calibrate the head in head_dir (default: the draft directory) on held-out `data`. With `out_dir`, the
    calibrated head (the same weights, the new temperatures) is written there as a new head directory
    (atomically; an existing head there is replaced only with overwrite); the inputs are never modified.
    With `report_path`, the report (and PNGs beside it) is written. Both destinations are checked before
    any work, and so is the data (at least MIN_CONTEXTS distinct contexts)."""
    import time

    from dspark_trt.models.confidence_head import head_files, load_head, save_temperatures
    from dspark_trt.models.config import load_config
    from dspark_trt.outputs import check_out_file
    from dspark_trt.training.head_output import check_head_out, copy_head, write_head_dir
    from dspark_trt.training.head_training import head_logits
    from dspark_trt.training.rollout import rollout_from_dirs

    num_contexts = num_contexts or DEFAULT_CONTEXTS
    context_len = context_len or DEFAULT_CONTEXT_LEN
    if labels not in ("expected", "greedy"):
        raise DsparkError(f"unknown labels {labels!r} (use 'greedy' or 'expected')")
    head_dir = Path(head_dir) if head_dir is not None else Path(draft_dir)
    out = None
    if out_dir is not None:
        out = check_head_out(out_dir, overwrite, {"--target": target_dir, "--draft": draft_dir, "--head": head_dir},
                             "calibrate")
    if report_path is not None:
        check_out_file(report_path, "--report")
    head = load_head(head_dir)
    if max_draft > head.max_draft:
        raise DsparkError(f"--max-draft {max_draft} exceeds the head's max_draft {head.max_draft} "
                          f"(retrain the head with --max-draft {max_draft})")
    t0 = time.perf_counter()
    dcfg = load_config(draft_dir)
    if head.hidden_size != dcfg.hidden_size or head.vocab_size != dcfg.vocab_size:
        raise DsparkError(f"the head in {head_dir} was trained for hidden size {head.hidden_size} / vocab "
                          f"{head.vocab_size}, the draft has {dcfg.hidden_size} / {dcfg.vocab_size}")
    ro = rollout_from_dirs(target_dir, draft_dir, data, num_contexts=num_contexts, max_draft=max_draft,
                           context_len=context_len, batch_size=batch_size, seed=seed, progress=progress,
                           desc="rollout (calibrate)", min_contexts=MIN_CONTEXTS, purpose="calibrate on")
    t1 = time.perf_counter()
    z = head_logits(head, ro.hidden, ro.prev_token, ro.stats_for(head.stats))
    result = calibrate_arrays(z, ro.survival(labels), ro.fallback_conf, ro.survival_greedy, n_bins, strategy,
                              labels=labels)
    temps = list(result.temperatures) + [float(t) for t in head.temperatures[max_draft:]]
    head_labels = (json.loads(head_files(head_dir)[1].read_text()).get("training") or {}).get("labels")
    result.summary["head_labels"] = head_labels
    result.summary["warnings"] = bias_warnings(result, head_labels)
    result.summary.update({"data": str(data), "head_dir": str(head_dir), "seed": seed, "rollout": ro.info,
                           "out_dir": str(out_dir) if out is not None else None,
                           "head_temperatures_saved": temps if out is not None else None,
                           "seconds": {"rollout": round(t1 - t0, 2), "fit": round(time.perf_counter() - t1, 2)}})
    if out is not None:
        def write(tmp: Path) -> None:
            copy_head(head_dir, tmp)
            save_temperatures(tmp, temps)

        write_head_dir(out, write)
        result.head_path = Path(out_dir)
    if report_path is not None:
        write_report(result, report_path)
    return result


def bias_warnings(result: CalibrationResult, head_labels: str | None, tolerance: float = 0.05) -> list[str]:
    """Temperature scaling rescales logits but cannot shift them: a head whose mean confidence is off (e.g.
    trained on 1 - TV labels, calibrated against greedy matches) stays biased. Say so."""
    s = result.summary
    obs, pred = s.get("survival_observed") or [], s.get("survival_predicted") or []
    if not obs:
        return []
    gap = pred[0] - obs[0]
    if abs(gap) <= tolerance:
        return []
    msg = (f"after calibration the mean survival at k=1 is {pred[0]:.3f} but {obs[0]:.3f} is observed: "
           "temperatures cannot remove a bias")
    if head_labels and head_labels != s.get("labels"):
        msg += (f"; the head was trained on {head_labels!r} labels and is calibrated against {s.get('labels')!r} "
                f"survival (retrain with --labels {s.get('labels')} for this decoding mode)")
    return [msg]


def write_report(result: CalibrationResult, report_path) -> Path:
    report_path = Path(report_path)
    report_path.parent.mkdir(parents=True, exist_ok=True)
    result.report_path = report_path
    result.figure_paths = plot_reliability(result, report_path.parent, report_path.stem)
    result.summary["figures"] = [p.name for p in result.figure_paths]
    report_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    return report_path


def plot_reliability(result: CalibrationResult, out_dir, stem: str) -> list[Path]:
    """One reliability diagram per draft position: <stem>_k<k>.png."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    paths = []
    for p, fb in zip(result.positions, result.fallback):
        k = p["k"]
        bins = result.bins.get(k)
        if bins is None:
            continue
        fig, (ax, hx) = plt.subplots(2, 1, figsize=(5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
        ax.plot([0, 1], [0, 1], color="0.6", linestyle="--", linewidth=1, label="perfect")
        for name, style, label in (
                ("before", dict(color="tab:orange", marker="s"), f"head, T=1 (ECE {p['ece_before']:.3f})"),
                ("after", dict(color="tab:blue", marker="o"), f"head, T={p['temperature']:.2f} (ECE {p['ece_after']:.3f})"),
                ("fallback", dict(color="tab:gray", marker="^"), f"max-prob fallback (ECE {fb['ece']:.3f})")):
            b = bins[name]
            ok = b.count > 0
            ax.plot(b.mean_conf[ok], b.mean_outcome[ok], linewidth=1.2, markersize=4, label=label, **style)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_ylabel("observed survival")
        auc = "n/a" if p["auroc"] is None or not math.isfinite(p["auroc"]) else f"{p['auroc']:.3f}"
        ax.set_title(f"draft position k={k}: survival S_k (AUROC {auc}, n={p['n']})", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        b = bins["after"]
        centers = (b.edges[:-1] + b.edges[1:]) / 2
        hx.bar(centers, b.count, width=np.diff(b.edges), color="tab:blue", alpha=0.6, edgecolor="white")
        hx.set_xlabel("predicted survival S_k")
        hx.set_ylabel("count")
        fig.tight_layout()
        path = Path(out_dir) / f"{stem}_k{k}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths
