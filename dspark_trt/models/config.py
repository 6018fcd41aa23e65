"""Model facts read from a Hugging Face config.json (Llama, Qwen2, Qwen3, Mistral)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dspark_trt.errors import DsparkError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # config's attention_bias (Llama/Qwen3: on q, k, v and o)
    qk_norm: bool = False  # Qwen3: RMSNorm on each head of q and k
    max_position_embeddings: int = 2048
    extra: dict = field(default_factory=dict)

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.attention_bias and self.model_type != "qwen2"

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def to_dict(self) -> dict:
        return asdict(self)

    def to_hf_dict(self, dtype: str = "float32") -> dict:
        """A config.json that transformers reads back into the same architecture."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                "mistral": "MistralForCausalLM"}[self.model_type]
        d = {
            "architectures": [arch], "model_type": self.model_type, "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps, "rope_theta": self.rope_theta, "rope_scaling": self.rope_scaling,
            "tie_word_embeddings": self.tie_word_embeddings, "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu", "torch_dtype": dtype,
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        d.update(self.extra)
        return d


# rope_scaling types the decoder implements, and the fields each needs (yarn, dynamic and longrope are
# refused: their position-dependent or attention-scaled forms are not implemented).
ROPE_FIELDS = {"linear": ("factor",),
               "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def sliding_window_problem(cfg: "ModelConfig", max_context: int, source: str) -> str | None:
    """Sliding-window attention is not implemented: it is exact only while the context fits the window."""
    window = cfg.extra.get("sliding_window")
    if window and max_context > int(window):
        return (f"{source} config.json sets sliding_window={window} (use_sliding_window), shorter than "
                f"--max-context {max_context}: sliding-window attention is not implemented; export with "
                f"--max-context {window} or less")
    return None


def _rope(raw: dict) -> tuple[float, dict | None]:
    # transformers >= 5 may nest theta and scaling under "rope_parameters".
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta", params.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling")
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            return theta, None
        if kind not in ROPE_FIELDS:
            raise DsparkError(f"config.json rope_scaling.rope_type {kind!r} is not supported (supported: default, "
                              f"{', '.join(ROPE_FIELDS)}); export a checkpoint without it or with one of these")
        missing = [f for f in ROPE_FIELDS[kind] if scaling.get(f) is None]
        if missing:
            raise DsparkError(f"config.json rope_scaling ({kind}) is missing {', '.join(missing)}")
        scaling = dict(scaling, rope_type=kind)
    return theta, scaling or None


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise DsparkError(f"unsupported model_type {model_type!r} in {source} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        if key not in raw:
            raise DsparkError(f"{source} is missing {key!r}")
    heads = int(raw["num_attention_heads"])
    theta, scaling = _rope(raw)
    sliding = raw.get("sliding_window") if raw.get("use_sliding_window", model_type == "mistral") else None
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(raw["hidden_size"]),
        intermediate_size=int(raw["intermediate_size"]),
        num_hidden_layers=int(raw["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        extra={"sliding_window": sliding} if sliding else {},
    )


def read_config_json(model_dir: str | Path, what: str = "a Hugging Face model directory") -> tuple[dict, Path]:
    """(the parsed config.json of model_dir, its path), or a one-line DsparkError naming what to point at."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DsparkError(f"no config.json in {model_dir}: point at {what}")
    try:
        return json.loads(path.read_text()), path
    except json.JSONDecodeError as e:
        raise DsparkError(f"{path} is not valid JSON: {e}") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    raw, path = read_config_json(model_dir)
    return config_from_dict(raw, source=str(path))
