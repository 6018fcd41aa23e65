"""Write a deliberately wrong copy of a cost profile, for `dspark-trt bench --start-profile` (issue 22).

    python scripts/distort_profile.py IN OUT --draft-scale 3     # draft calls priced 3x too dear
    python scripts/distort_profile.py IN OUT --flat-verify       # every verify call priced as a one-token call

IN is a cost_profile*.json; OUT must not exist. The meta keeps the artifact's hashes (so the bench accepts it)
and records the distortion under ``distorted``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def distort(profile: dict, draft_scale: float = 1.0, flat_verify: bool = False) -> dict:
    p = json.loads(json.dumps(profile))
    pts = p.get("points") or {}
    if draft_scale != 1.0:
        p["draft_ms"] = [x * draft_scale for x in p["draft_ms"]]
        pts["draft"] = {k: [x * draft_scale for x in v] for k, v in (pts.get("draft") or {}).items()}
        pts["draft_median"] = {k: v * draft_scale for k, v in (pts.get("draft_median") or {}).items()}
    if flat_verify:
        one = p["verify_ms"][1]
        p["verify_ms"] = [0.0] + [one] * (len(p["verify_ms"]) - 1)
        pts["verify"] = {k: [one] * len(v) for k, v in (pts.get("verify") or {}).items()}
        pts["verify_median"] = {k: one for k in pts.get("verify_median") or {}}
        shapes = pts.get("verify_shapes") or []
        if shapes:
            low = min(s[-1] for s in shapes)
            pts["verify_shapes"] = [s[:-1] + [low] for s in shapes]
    p["points"] = pts
    p["meta"] = dict(p.get("meta") or {}, distorted={"draft_scale": draft_scale, "flat_verify": flat_verify})
    return p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--draft-scale", type=float, default=1.0)
    ap.add_argument("--flat-verify", action="store_true")
    a = ap.parse_args(argv)
    if a.out.exists():
        print(f"error: {a.out} already exists", file=sys.stderr)
        return 1
    a.out.write_text(json.dumps(distort(json.loads(a.src.read_text()), a.draft_scale, a.flat_verify), indent=1) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
