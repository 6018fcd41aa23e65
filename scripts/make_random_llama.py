"""Write a random-weight HF Llama/Qwen2 checkpoint of a chosen size, shard by shard, in bounded memory.

For size and memory tests of the exporter and runtime (weights are noise; use a real checkpoint for
quality). Tensors are generated one at a time and written in shards of --shard-mb, so peak RSS stays
near one shard. The tokenizer (and tokenizer_config.json / generation_config.json when present) is
copied from --tokenizer-from.

    python scripts/make_random_llama.py OUT --hidden 1536 --layers 24 --heads 12 --kv-heads 4 \
        --intermediate 4864 --tokenizer-from examples/models/stdlib-target --shard-mb 1000
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from dspark_trt.models.synthetic import llama_config, write_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model-type", default="llama", choices=["llama", "qwen2"])
    ap.add_argument("--vocab", type=int, default=None, help="default: the tokenizer's vocabulary size")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--tie", action="store_true")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--shard-mb", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-extra", default="{}", help="JSON merged into config.json (e.g. rope_scaling)")
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    a = ap.parse_args()
    tok = a.tokenizer_from / "tokenizer.json"
    vocab = a.vocab or max(json.loads(tok.read_text())["model"]["vocab"].values()) + 1
    cfg = llama_config(vocab, a.hidden, a.layers, a.heads, a.kv_heads, a.intermediate, a.model_type, a.tie)
    cfg.update(json.loads(a.config_extra))
    write_checkpoint(a.out, cfg, a.dtype, a.shard_mb << 20, a.seed)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (a.tokenizer_from / name).is_file():
            shutil.copyfile(a.tokenizer_from / name, a.out / name)
    size = sum(p.stat().st_size for p in a.out.glob("*.safetensors"))
    print(f"wrote {a.out}: {size / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
