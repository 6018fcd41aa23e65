"""Write docs/tuning.md from dspark_trt/runtime/tuning.py (tests/test_tuning.py fails when it is stale)."""

from pathlib import Path

from dspark_trt.runtime.tuning import tuning_markdown

if __name__ == "__main__":
    out = Path(__file__).resolve().parents[1] / "docs" / "tuning.md"
    out.write_text(tuning_markdown())
    print(f"wrote {out}")
