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
    at the same concurrency. ``runs``: results.json run rows; ``peers``: peer rows (open markers at their
    concurrencies, joined where a peer ran at several)."""
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
    # Peers: open markers, joined by a thin grey line where a peer ran at several concurrencies.
    peer_modes = list(dict.fromkeys(p["mode"] for p in peers or [] if p.get("output_tok_s")))
    for mode, marker in zip(peer_modes, ("s", "^", "D", "v", "P", "X", "<", ">", "h")):
        pts = sorted((p["concurrency"], p["output_tok_s"]) for p in peers if p["mode"] == mode and p.get("output_tok_s"))
        style = dict(marker=marker, ms=7, color="grey", mfc="none", mec="black", lw=1, ls=":", zorder=5, label=mode)
        ax1.plot([x for x, _ in pts], [y for _, y in pts], **style)
        sp = [(x, y / off[x]) for x, y in pts if off.get(x)]
        if sp:
            ax2.plot([x for x, _ in sp], [y for _, y in sp], **style)
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
