"""throughput.png: output tok/s vs concurrency per mode, and speed-up over `off` (matplotlib, lazy)."""

from __future__ import annotations

from pathlib import Path


def _mode_key(mode: str):
    if mode == "off":
        return (0, 0)
    if mode.startswith("fixed:"):
        return (1, int(mode[6:]))
    return (2, 0) if mode == "adaptive" else (3, mode)


def plot_throughput(runs: list[dict], path, title: str = "", peers: list[dict] | None = None) -> Path:
    """Two panels over concurrency (log2 axis): output tok/s per mode, and each mode's speed-up over `off`
    at the same concurrency. ``runs``: results.json run rows; ``peers``: peer rows (drawn as markers at
    their concurrency, 1)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in runs}, key=_mode_key)
    off = {r["concurrency"]: r["output_tok_s"] for r in runs if r["mode"] == "off"}
    fixed = [m for m in modes if m.startswith("fixed:")]
    cmap = plt.get_cmap("viridis")
    colors = {m: cmap(0.15 + 0.7 * i / max(1, len(fixed) - 1)) for i, m in enumerate(fixed)}
    colors.update({"off": "black", "adaptive": "tab:red"})

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8))
    for m in modes:
        rows = sorted((r for r in runs if r["mode"] == m), key=lambda r: r["concurrency"])
        xs = [r["concurrency"] for r in rows]
        style = dict(color=colors.get(m), marker="o", ms=4, label=m,
                     lw=2.4 if m in ("off", "adaptive") else 1.2, ls="--" if m == "off" else "-")
        ax1.plot(xs, [r["output_tok_s"] for r in rows], **style)
        sp = [(r["concurrency"], r["output_tok_s"] / off[r["concurrency"]]) for r in rows
              if off.get(r["concurrency"])]
        if sp and m != "off":
            ax2.plot([x for x, _ in sp], [y for _, y in sp], **style)
    for p, marker in zip(peers or [], ("s", "^", "D", "v")):
        ax1.scatter([p["concurrency"]], [p["output_tok_s"]], marker=marker, s=60, zorder=5,
                    edgecolors="black", facecolors="none", label=p["mode"])
        if off.get(p["concurrency"]):
            ax2.scatter([p["concurrency"]], [p["output_tok_s"] / off[p["concurrency"]]], marker=marker, s=60,
                        zorder=5, edgecolors="black", facecolors="none", label=p["mode"])
    ax2.axhline(1.0, color="black", lw=1, ls="--")
    for ax, ylabel in ((ax1, "output tokens / s"), (ax2, "speed-up over off")):
        ax.set_xscale("log", base=2)
        cs = sorted({r["concurrency"] for r in runs})
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
        ax.set_xlabel("concurrency (requests in flight)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.set_title("throughput")
    ax2.set_title("speed-up over no speculation")
    ax1.legend(fontsize=8, ncol=2)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
