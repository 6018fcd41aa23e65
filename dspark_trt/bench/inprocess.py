"""The open loop in process: requests submitted to a Runtime at their arrival times, every token timed.

Uses the Runtime's public API only: ``submit(ids, config, stream=True)`` returns a Request whose
``pieces`` queue delivers each step's committed token ids (None at the end); ``slot`` becomes >= 0 when
the request is admitted to a batch slot (the queue wait); ``finish_reason``/``error`` say how it ended.
"""

from __future__ import annotations

import threading
import time


def new_record(i: int, item, arrival_s: float) -> dict:
    return {"index": i, "kind": item.kind, "temperature": item.temperature, "prompt_tokens": len(item.ids),
            "max_tokens": item.max_tokens, "arrival_s": float(arrival_s), "sent_s": None, "admitted_s": None,
            "token_times_s": [], "token_counts": [], "generated_tokens": 0, "ok": False, "error": None}


def run_inprocess(rt, items, arrivals, mode: str, poll_s: float = 0.002) -> tuple[list[dict], float]:
    """Submit ``items[i]`` at ``arrivals[i]`` seconds in ``mode``; returns (records, wall seconds from the
    schedule's start to the last answer). Every request generates exactly its max_tokens (EOS does not
    stop it), so every mode emits the same number of tokens."""
    from dspark_trt.runtime.config import GenerationConfig

    records = [new_record(i, it, at) for i, (it, at) in enumerate(zip(items, arrivals))]
    readers: list[threading.Thread] = []
    waiting: list[tuple[dict, object]] = []  # submitted, not yet admitted
    t0 = time.perf_counter()

    def read(req, rec):
        times = rec["token_times_s"]
        n = 0
        while True:
            ids = req.pieces.get()
            if ids is None:
                break
            now = time.perf_counter() - t0
            times.append(now)  # one delivery, one timestamp (see latency.request_latencies)
            rec["token_counts"].append(len(ids))
            n += len(ids)
        rec["generated_tokens"] = n
        if len(req.delivered) == len(times):
            # The runtime's own stamps: a reader that waited for the GIL would have seen two deliveries at once.
            times[:] = [d - t0 for d in req.delivered]
        finish_record(rec, req)

    def stamp_admissions():
        now = time.perf_counter() - t0
        keep = []
        for rec, req in waiting:
            if getattr(req, "slot", 0) >= 0 or req.finished:
                rec["admitted_s"] = now if getattr(req, "slot", -1) >= 0 else None
            else:
                keep.append((rec, req))
        waiting[:] = keep

    for rec, item in zip(records, items):
        while True:
            stamp_admissions()
            wait = t0 + rec["arrival_s"] - time.perf_counter()
            if wait <= 0:
                break
            time.sleep(min(wait, poll_s))
        cfg = GenerationConfig(max_new_tokens=item.max_tokens, temperature=item.temperature, spec=mode,
                               seed=item.seed, stop_at_eos=False)
        rec["sent_s"] = time.perf_counter() - t0
        try:
            req = rt.submit(item.ids, cfg, stream=True)
        except Exception as e:  # a full queue or a closed runtime: this request failed
            rec["error"] = f"{type(e).__name__}: {e}"
            continue
        waiting.append((rec, req))
        t = threading.Thread(target=read, args=(req, rec), daemon=True, name=f"bench-open-{rec['index']}")
        t.start()
        readers.append(t)
    while waiting:
        stamp_admissions()
        time.sleep(poll_s)
    for t in readers:
        t.join()
    return records, run_end(records)


def finish_record(rec: dict, req) -> None:
    """How a finished request ended, and what the runtime decided and predicted for it (summed per (rate,
    mode) in open_loop._entry)."""
    st = req.stats
    rec["spec"] = {"steps": st.steps, "generated": st.generated, "predicted_accepted": st.predicted_accepted,
                   "accepted": st.accepted, "predicted_step_ms": st.predicted_step_ms,
                   "measured_step_ms": st.measured_step_ms}
    rec["ok"] = req.finish_reason not in ("error", "cancelled", None) and not req.error
    rec["error"] = req.error or (None if rec["ok"] else f"finished: {req.finish_reason}")


def run_end(records: list[dict]) -> float:
    """Seconds from the schedule's start to the last answer (or the last send, if nothing came back)."""
    return max([r["token_times_s"][-1] for r in records if r["token_times_s"]]
               + [r["sent_s"] for r in records if r["sent_s"] is not None] + [0.0])
