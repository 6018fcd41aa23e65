"""Load and save Hugging Face checkpoint directories (config.json + safetensors, sharded or not)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dspark_trt.errors import DsparkError
from dspark_trt.models.config import ModelConfig, load_config
from dspark_trt.models.decoder import Decoder, rope_inv_freq

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
           "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise DsparkError(f"unknown dtype {name!r} (use fp32, fp16 or bf16)") from None


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint: model.safetensors, or the shards its index lists."""
    model_dir = Path(model_dir)
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except json.JSONDecodeError as e:
            raise DsparkError(f"{index} is not valid JSON: {e}") from None
        files = []
        for shard in sorted(set(weight_map.values())):
            path = model_dir / shard
            if not path.is_file():
                raise DsparkError(f"shard {shard} listed in {index} is missing")
            files.append(path)
        return files
    raise DsparkError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def read_state_dict(model_dir: str | Path, dtype: torch.dtype | None = None, keys=None) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint (sharded or not), read one at a time and converted to `dtype` on the
    way in, so peak memory is the converted weights plus one tensor (bf16 on disk -> fp32 is fine).
    keys: only these names (others are skipped without being read)."""
    from safetensors import safe_open

    state = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if keys is not None and name not in keys:
                    continue
                t = f.get_tensor(name)
                state[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return state


def load_decoder(model_dir: str | Path, dtype: str | torch.dtype = "fp32") -> Decoder:
    """Build a Decoder from a HF checkpoint directory; missing tensors are a DsparkError naming the key.

    The module is built on the meta device and the checkpoint's tensors are assigned into it, so the
    weights exist once in memory (no random init, no second copy)."""
    cfg = load_config(model_dir)
    dtype = torch_dtype(dtype) if isinstance(dtype, str) else dtype
    with torch.device("meta"):
        model = Decoder(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    state = read_state_dict(model_dir, dtype, keys=set(expected))
    for key, shape in expected.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if key not in state:
            hint = (" (config.json says tie_word_embeddings=false; set it to true if the checkpoint shares "
                    "the embedding with lm_head)") if key == "lm_head.weight" else ""
            raise DsparkError(f"checkpoint {model_dir} is missing tensor {key!r}{hint}")
        if tuple(state[key].shape) != shape:
            raise DsparkError(f"tensor {key!r} in {model_dir} has shape {tuple(state[key].shape)}, "
                              f"config.json implies {shape}")
    state.pop("lm_head.weight", None) if cfg.tie_word_embeddings else None
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(cfg)  # a computed buffer: not in the checkpoint, still on meta
    return model.eval()


def save_decoder(model: Decoder, model_dir: str | Path, dtype: str = "fp32") -> None:
    from safetensors.torch import save_file

    model_dir = Path(model_dir)
    model_dir.mkdir(parents=True, exist_ok=True)
    dt = torch_dtype(dtype)
    state = {k: v.detach().to(dt).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    hf_name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dt]
    (model_dir / "config.json").write_text(json.dumps(model.config.to_hf_dict(hf_name), indent=2) + "\n")


def config_of(model_dir: str | Path) -> ModelConfig:
    return load_config(model_dir)


def check_same_vocab(target_dir: str | Path, draft_dir: str | Path) -> None:
    """Draft and target must share a tokenizer; a mismatch makes speculation meaningless."""
    t, d = load_config(target_dir), load_config(draft_dir)
    if t.vocab_size != d.vocab_size:
        raise DsparkError(f"draft vocab_size {d.vocab_size} differs from target vocab_size {t.vocab_size}: "
                          "the draft must use the target's tokenizer")
    tt, dt = Path(target_dir) / "tokenizer.json", Path(draft_dir) / "tokenizer.json"
    vt = _vocab_of(tt) if tt.is_file() else None
    vd = _vocab_of(dt) if dt.is_file() else None
    if vt is not None and vd is not None and vt != vd:
        raise DsparkError(f"{dt} and {tt} define different vocabularies: the draft must use the target's tokenizer")


def _vocab_of(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DsparkError(f"{path} is not a valid tokenizer.json (not UTF-8 text: {e.reason}): restore it from "
                          f"the model's source") from None
    except json.JSONDecodeError as e:
        raise DsparkError(f"{path} is not a valid tokenizer.json (line {e.lineno}, column {e.colno}: {e.msg}): "
                          f"restore it from the model's source") from None
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise DsparkError(f"{path} is not a valid tokenizer.json (no 'model' object): restore it from the "
                          f"model's source")
    return model.get("vocab", {})
