"""Peers inside the closed loop: which peer engines to run (``--peer-engines``), starting them, measuring
them at each concurrency in the same rounds as our modes, and their results rows.

Engines:
- ``hf``: transformers generate and assisted generation at batch 1 (:mod:`dspark_trt.bench.peers`).
- ``ortgenai``: onnxruntime-genai, the target converted by its model builder, plain greedy decoding in
  static batches of ``concurrency`` requests, at every level up to its batch limit
  (:mod:`dspark_trt.bench.peer_ortgenai`).
- ``vllm``: vLLM's engine, plainly and with the same draft at each fixed K of ``--modes``
  (:mod:`dspark_trt.bench.peer_vllm`), when the peer Python can import vllm.

``auto`` (the default of ``--peers``) runs each engine whose package is there and says why it skipped
the others; naming an engine makes its absence an error.
"""

from __future__ import annotations

import re

from dspark_trt.bench.latency import summarize_requests
from dspark_trt.errors import DsparkError

ENGINES = ("hf", "ortgenai", "vllm")
# onnxruntime-genai 0.18 refuses a generator batch above 32 ("batch_size (64) must be in [1, 32]").
ORTGENAI_MAX_BATCH = 32


def parse_peer_engines(value) -> tuple[list[str], bool]:
    """'auto' -> (all engines, False); 'hf,ortgenai' -> (those, True: each must be available)."""
    text = str(value).strip().lower()
    if text == "auto":
        return list(ENGINES), False
    out = []
    for s in text.split(","):
        s = s.strip()
        if s not in ENGINES:
            raise DsparkError(f"--peer-engines {value!r}: {s!r} is not a peer engine (choose from "
                              f"{', '.join(ENGINES)}, comma-separated, or auto)")
        if s not in out:
            out.append(s)
    return out, True


def available(engine: str, python: str) -> str | None:
    """None when ``engine`` can run, else why not (one line naming what to install)."""
    if engine == "hf":
        import importlib.util

        missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
        if missing:
            return f"the transformers peer needs {' and '.join(missing)} (pip install torch transformers)"
        return None
    if engine == "ortgenai":
        from dspark_trt.bench import peer_ortgenai

        return None if peer_ortgenai.probe(python) else (f"the onnxruntime-genai peer needs the onnxruntime-genai "
                                                        f"package in {python}: {peer_ortgenai.INSTALL_HINT}")
    from dspark_trt.bench import peer_vllm

    if peer_vllm.probe(python):
        return None
    return f"the vLLM peer needs the vllm package in {python}: {peer_vllm.INSTALL_HINT}"


def choose(engines: list[str], explicit: bool, python: str, say,
           temperature: float = 0.0) -> tuple[list[str], list[str]]:
    """(engines to run, notes on the skipped ones); an explicitly named engine that cannot run is an error.
    The onnxruntime-genai and vLLM peers decode greedily only (their samplers draw other random numbers, so
    nothing would be compared): at a temperature above 0 they are left out."""
    run, notes = [], []
    for e in engines:
        why = (f"the {e} peer runs greedy decoding only (this bench samples at temperature {temperature:g})"
               if e != "hf" and temperature > 0 else available(e, python))
        if why is None:
            run.append(e)
        elif explicit:
            raise DsparkError(why)
        else:
            notes.append(f"peer {e} skipped: {why}")
            say(f"note: {notes[-1]}")
    return run, notes


def start(engines: list[str], manifest: dict, prompts: list[list[int]], python: str, fixed_ks: list[int],
          max_batch: int, say) -> list:
    """The multi-concurrency peers (ortgenai, vllm modes) started, model converted/loaded and warmed up."""
    src = manifest.get("sources") or {}
    peers = []
    try:
        if "ortgenai" in engines:
            from dspark_trt.bench.peer_ortgenai import OrtGenaiPeer

            peers.append(OrtGenaiPeer(python, src.get("target"), prompts, say))
            peers[-1].max_batch = ORTGENAI_MAX_BATCH
        if "vllm" in engines:
            from dspark_trt.bench.peer_vllm import VllmPeer, modes_for

            for mode in modes_for(fixed_ks):
                say(f"starting the vLLM peer ({mode})")
                peers.append(VllmPeer(python, mode, src.get("target"), src.get("draft"), prompts, max_batch,
                                      int(manifest["limits"]["max_context"])))
                peers[-1].max_batch = max_batch
        for p in peers:  # sessions, allocators: outside the timing, as our own warm-up
            p.run(min(max_batch, p.max_batch), min(max_batch, p.max_batch), 8)
    except BaseException:
        close(peers)
        raise
    return peers


def close(peers) -> None:
    for p in peers:
        p.close()


def measure(peer, concurrency: int, n_requests: int, max_new_tokens: int) -> dict | None:
    """One closed-loop run of ``peer`` at ``concurrency``; None where the peer cannot batch that many."""
    if concurrency > peer.max_batch:
        return None
    return peer.run(concurrency, n_requests, max_new_tokens)


def rows_for_level(peers, raw: dict, c: int, ours: list[dict] | None, temperature: float) -> list[dict]:
    """Results rows of concurrency ``c``: per peer its rounds summed (``raw[mode]``: list of runs, or None
    where unsupported), greedy outputs compared request by request with ``ours`` (our off runs at c,
    one per round; every request i uses prompt i mod num_prompts in both)."""
    rows = []
    for p in peers:
        runs = raw.get(p.mode)
        row = {"engine": p.engine, "mode": p.mode, "concurrency": c, "label": p.label, "batching": p.batching,
               "versions": dict(p.versions), **{k: v for k, v in p.info.items() if k != "python"}}
        if not runs:
            row.update(output_tok_s=None, skipped=f"max batch {p.max_batch}")
            rows.append(row)
            continue
        reqs = [r for run in runs for r in run["requests"]]
        row.update(summarize_requests(reqs, sum(run["wall_s"] for run in runs)))
        row["round_output_tok_s"] = [sum(r["generated_tokens"] for r in run["requests"]) / run["wall_s"]
                                     for run in runs]
        row["greedy_match_off"] = row["identical"] = None
        if temperature == 0 and ours:
            pairs = [(a["token_ids"], b["token_ids"]) for run, base in zip(runs, ours)
                     for a, b in zip(run["requests"], base["requests"])]
            row["greedy_match_off"] = sum(a == b for a, b in pairs) / len(pairs) if pairs else None
            row["identical"] = bool(pairs) and all(a == b for a, b in pairs)
        rows.append(row)
    return rows


def comparison(runs: list[dict], peer_rows: list[dict]) -> list[dict]:
    """Per concurrency with a multi-concurrency peer: our off, best fixed K and adaptive against each peer,
    all as whole-run throughput (the peers' static batches have no steady-state window), with the paired
    per-round ratios (our mode and the peer ran in the same round)."""
    out = []
    for c in sorted({r["concurrency"] for r in peer_rows if r.get("engine") != "hf"}):
        ours = {r["mode"]: r for r in runs if r["concurrency"] == c}
        fixed = [r for m, r in ours.items() if m.startswith("fixed:")]
        best = max(fixed, key=lambda r: r["output_tok_s_whole_run"]) if fixed else None
        picks = [("off", ours.get("off")), ("best fixed", best), ("adaptive", ours.get("adaptive"))]
        entry = {"concurrency": c, "ours": {}, "peers": {}}
        for name, r in picks:
            if r is not None:
                entry["ours"][name] = {"mode": r["mode"], "output_tok_s": r["output_tok_s_whole_run"],
                                       "steady_output_tok_s": r["output_tok_s"]}
        for p in (p for p in peer_rows if p["concurrency"] == c and p.get("engine") != "hf"):
            item = {"output_tok_s": p.get("output_tok_s"), "identical": p.get("identical"), "skipped": p.get("skipped")}
            for name, r in picks:
                if r is None or not p.get("output_tok_s"):
                    continue
                item[f"{name.replace(' ', '_')}_over_peer"] = r["output_tok_s_whole_run"] / p["output_tok_s"]
                mine, theirs = r.get("round_output_tok_s_whole_run") or [], p.get("round_output_tok_s") or []
                if len(mine) == len(theirs) and mine:
                    item[f"{name.replace(' ', '_')}_over_peer_rounds"] = [a / b for a, b in zip(mine, theirs) if b]
            entry["peers"][p["mode"]] = item
        out.append(entry)
    return out


def fixed_ks(modes: list[str]) -> list[int]:
    return [int(m[6:]) for m in modes if re.fullmatch(r"fixed:\d+", m)]
