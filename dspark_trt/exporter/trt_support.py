"""What the TensorRT ONNX parser accepts, from the bundled `data/trt_onnx_ops.json`.

The data file is built from onnx-tensorrt `docs/operators.md` (the revision and retrieval date are in the
file itself) plus the 10.x `docs/Changelog.md` entries that say when an op was added (`since`). No
TensorRT or onnx import is needed here.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

from dspark_trt.errors import DsparkError

DATA_FILE = Path(__file__).with_name("data") / "trt_onnx_ops.json"
MIN_LIST_VERSION = (10, 0)  # the bundled list describes TensorRT 10.0 and later

# ONNX TensorProto.DataType numbers -> names used in this project (stable across onnx releases).
ONNX_DTYPE_NAMES = {
    1: "float32", 2: "uint8", 3: "int8", 4: "uint16", 5: "int16", 6: "int32", 7: "int64", 8: "string",
    9: "bool", 10: "float16", 11: "float64", 12: "uint32", 13: "uint64", 14: "complex64", 15: "complex128",
    16: "bfloat16", 17: "float8e4m3fn", 18: "float8e4m3fnuz", 19: "float8e5m2", 20: "float8e5m2fnuz",
    21: "uint4", 22: "int4", 23: "float4e2m1", 24: "float8e8m0", 25: "uint2", 26: "int2", 27: "float6e2m3",
    28: "float6e3m2",
}


def onnx_dtype_name(elem_type: int) -> str:
    return ONNX_DTYPE_NAMES.get(int(elem_type), f"onnx-type-{int(elem_type)}")


def parse_version(text: str) -> tuple[int, ...]:
    """'10.9' / '10.9.0.34' / '11.0.0' -> tuple of ints; DsparkError for anything else."""
    s = str(text).strip()
    m = re.match(r"^(\d+)\.(\d+)(?:\.(\d+))?(?:\.(\d+))?", s)
    if not m:
        raise DsparkError(f"TensorRT version {text!r} is not like 10.9 or 11.0.1")
    return tuple(int(g) for g in m.groups() if g is not None)


def version_at_least(version: str | tuple, minimum: str | tuple) -> bool:
    v = parse_version(version) if isinstance(version, str) else tuple(version)
    m = parse_version(minimum) if isinstance(minimum, str) else tuple(minimum)
    width = max(len(v), len(m))
    return v + (0,) * (width - len(v)) >= m + (0,) * (width - len(m))


@functools.lru_cache(maxsize=1)
def load_op_table() -> dict:
    """The bundled data file as a dict (cached)."""
    try:
        return json.loads(DATA_FILE.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DsparkError(f"bundled TensorRT op list {DATA_FILE} is missing: reinstall dspark-trt") from None


@dataclass(frozen=True)
class TrtSupport:
    """The op / dtype / opset rules for one targeted TensorRT version."""

    version: str          # the version linted against, e.g. "10.15" (the list's own) or what the user asked
    list_version: str     # the version the bundled list was written for
    source: str
    revision: str

    @property
    def table(self) -> dict:
        return load_op_table()

    # ---- ops
    def op_entry(self, op_type: str) -> dict | None:
        return self.table["ops"].get(op_type)

    def unsupported_reason(self, op_type: str) -> str | None:
        """None when the parser imports this standard-domain op natively, else why not."""
        entry = self.op_entry(op_type)
        if entry is None:
            return f"not in the TensorRT ONNX parser's operator list ({self.source}, TensorRT {self.list_version})"
        if not entry.get("supported"):
            extra = f" ({entry['restrictions']})" if entry.get("restrictions") else ""
            return f"marked unsupported in {self.source} (TensorRT {self.list_version}){extra}"
        since = entry.get("since")
        if since and not version_at_least(self.version, since):
            return f"needs TensorRT >= {since} (targeting {self.version})"
        return None

    def restrictions(self, op_type: str) -> str | None:
        entry = self.op_entry(op_type)
        return entry.get("restrictions") if entry else None

    # ---- opsets
    @property
    def opset_min(self) -> int:
        return int(self.table["opset"]["min"])

    @property
    def opset_max(self) -> int:
        """Highest default-domain opset the targeted version parses (best known value at or below it)."""
        table = self.table["opset"]
        best = None
        for ver, mx in sorted(table.get("max_by_version", {}).items(), key=lambda kv: parse_version(kv[0])):
            if version_at_least(self.version, ver):
                best = int(mx)
        return best if best is not None else int(table["max"])

    # ---- dtypes
    def dtype_problem(self, dtype: str) -> str | None:
        """None when TensorRT accepts this ONNX tensor type, else a short reason."""
        d = self.table["dtypes"]
        if dtype in d.get("limited", {}):
            return d["limited"][dtype]
        if dtype in d["supported"]:
            return None
        return "TensorRT has no such tensor type"


def support_for(trt_version: str | None = None) -> TrtSupport:
    """Rules for the targeted TensorRT version (default: the version the bundled list describes)."""
    table = load_op_table()
    list_version = str(table["tensorrt_version"])
    version = list_version if trt_version in (None, "") else str(trt_version).strip()
    parsed = parse_version(version)
    if not version_at_least(parsed, MIN_LIST_VERSION):
        raise DsparkError(f"--trt-version {version}: the bundled operator list covers TensorRT 10.0 and later "
                          f"(dspark-trt needs >= 10.9)")
    return TrtSupport(version=version, list_version=list_version, source=str(table["source"]),
                      revision=str(table.get("revision", "")))
