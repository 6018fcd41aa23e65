"""The DSpark drafter checkpoint format as vLLM loads it (`Qwen3DSparkModel`): config fields.

A DSpark draft is a small Qwen3 decoder stack conditioned on the target: it reads the target's hidden
states at a few layers, projects their concatenation with `fc` and normalises it with `hidden_norm`
into a "context" from which every draft layer computes its own K/V; a query block (the anchor token
followed by mask tokens) goes through the stack in one parallel pass; a low-rank Markov head then adds
a bias from the previously drafted token, one position at a time; an optional confidence head
estimates each draft token's acceptance probability.

Field precedence follows vLLM 0.32 (`qwen3_dflash.py`, `qwen3_dspark.py`, `spec_decode/dspark/`,
`eagle3_utils.get_eagle3_aux_layers_from_config`, `spec_decode/utils.get_parallel_drafting_token_id`).
Variants we cannot run exactly are refused with a one-line DsparkError naming the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.models.config import ModelConfig, config_from_dict, read_config_json

DRAFTER_KIND = "dspark"
ARCHITECTURES = ("Qwen3DSparkModel",)
MASK_EMBEDDING_FILE = "mask_embedding.pt"


@dataclass
class DsparkConfig:
    """What the draft step needs beyond the decoder-stack facts in `layers`."""

    layers: ModelConfig  # the draft's own Qwen3 stack (vocab_size = input vocabulary)
    aux_layers: tuple[int, ...]  # target capture points (vLLM aux numbering: target_layer_ids + 1), sorted
    target_hidden_size: int
    mask_token_id: int
    causal: bool  # attention inside the query block
    markov_rank: int
    draft_vocab_size: int
    num_draft: int  # N: draft tokens per step (block_size)
    sample_from_anchor: bool = True  # N query slots (anchor + N-1 masks) vs 1 + N
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    draft_topk: int | None = None
    logit_scale: float = 1.0
    v_scale: float | None = None
    raw: dict = field(default_factory=dict, repr=False)

    @property
    def query_len(self) -> int:
        return self.num_draft if self.sample_from_anchor else self.num_draft + 1

    @property
    def hidden_size(self) -> int:
        return self.layers.hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size < self.layers.vocab_size

    def summary(self) -> dict:
        """The manifest record of this drafter."""
        return {"kind": DRAFTER_KIND, "aux_layers": list(self.aux_layers), "num_draft": self.num_draft,
                "query_len": self.query_len, "sample_from_anchor": self.sample_from_anchor,
                "causal": self.causal, "markov_rank": self.markov_rank, "mask_token_id": self.mask_token_id,
                "draft_vocab_size": self.draft_vocab_size, "draft_topk": self.draft_topk,
                "confidence_head": self.enable_confidence_head,
                "confidence_head_with_markov": self.confidence_head_with_markov}


def is_dspark_dir(draft_dir: str | Path) -> bool:
    """True when the folder's config.json declares a DSpark drafter (any variant, supported or not)."""
    path = Path(draft_dir) / "config.json"
    if not path.is_file():
        return False
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError:
        return False
    return any("DSpark" in str(a) for a in raw.get("architectures") or ())


def _nested(raw: dict, name: str):
    """vLLM's precedence for DFlash/DSpark keys: dflash_config, then eagle_config, then top level."""
    for section in ("dflash_config", "eagle_config"):
        sub = raw.get(section) or {}
        if isinstance(sub, dict) and sub.get(name) is not None:
            return sub[name]
    return raw.get(name)


def _aux_layers(raw: dict, src: str) -> tuple[int, ...]:
    """Target capture points in vLLM's aux numbering (k = residual stream after k target layers)."""
    if raw.get("eagle_aux_hidden_state_layer_ids"):
        ids = [int(i) for i in raw["eagle_aux_hidden_state_layer_ids"]]
    else:
        dflash = raw.get("dflash_config") or {}
        for key, ids in (("dflash_config.target_layer_ids", dflash.get("target_layer_ids")),
                         ("dspark_target_layer_ids", raw.get("dspark_target_layer_ids")),
                         ("target_layer_ids", raw.get("target_layer_ids"))):
            if ids:
                ids = [int(i) + 1 for i in ids]
                break
        else:
            ids = None
            for section in ("dflash_config", "eagle_config"):
                sub = raw.get(section) or {}
                if isinstance(sub, dict) and sub.get("layer_ids"):
                    ids = [int(i) for i in sub["layer_ids"]]
                    break
    if not ids:
        raise DsparkError(f"{src}: no target layers: set dflash_config.target_layer_ids "
                          "(or dspark_target_layer_ids / target_layer_ids)")
    # vLLM sorts and deduplicates the capture points; fc's input columns follow that order.
    return tuple(sorted(set(ids)))


def _refuse_unsupported(raw: dict, src: str) -> None:
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise DsparkError(f"{src}: architectures {archs} is not a supported DSpark drafter "
                          f"(supported: {', '.join(ARCHITECTURES)})")
    if raw.get("model_type") != "qwen3":
        raise DsparkError(f"{src}: model_type {raw.get('model_type')!r} is not supported for a DSpark draft "
                          "(supported: qwen3)")
    head_type = raw.get("markov_head_type", "vanilla")
    if head_type != "vanilla":
        raise DsparkError(f"{src}: markov_head_type {head_type!r} is not supported (supported: 'vanilla')")
    dflash = raw.get("dflash_config") or {}
    layer_types = raw.get("layer_types") or []
    if any(t == "sliding_attention" for t in layer_types):
        raise DsparkError(f"{src}: layer_types has sliding_attention draft layers, which are not supported")
    if dflash.get("use_swa"):
        raise DsparkError(f"{src}: dflash_config.use_swa (sliding-window draft layers) is not supported")
    if raw.get("use_sliding_window"):
        raise DsparkError(f"{src}: use_sliding_window (sliding-window draft layers) is not supported")
    if dflash.get("attention_sink_bias", raw.get("add_swa_attention_sink_bias", False)):
        raise DsparkError(f"{src}: dflash_config.attention_sink_bias is not supported")
    if raw.get("is_neox_style", True) is not True:
        raise DsparkError(f"{src}: is_neox_style false (interleaved RoPE in the draft) is not supported")
    if not _nested(raw, "use_aux_hidden_state") in (None, True):
        raise DsparkError(f"{src}: use_aux_hidden_state false (draft on the final hidden state) is not supported")
    if raw.get("quantization_config"):
        raise DsparkError(f"{src}: quantization_config is set; only unquantized DSpark drafts are supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise DsparkError(f"{src}: hidden_act {raw.get('hidden_act')!r} is not supported (supported: silu)")


def dspark_config_from_dict(raw: dict, target: ModelConfig, src: str = "config.json") -> DsparkConfig:
    """Parse and check a DSpark draft config against the target it drafts for."""
    _refuse_unsupported(raw, src)
    stack_raw = dict(raw)
    params = stack_raw.get("rope_parameters") or {}
    if "rope_theta" not in stack_raw and "rope_theta" not in params:
        stack_raw["rope_theta"] = 1_000_000.0  # vLLM's default for DFlash/DSpark layers
    stack_raw.pop("use_sliding_window", None)
    layers = config_from_dict(stack_raw, source=src)
    aux = _aux_layers(raw, src)
    bad = [k - 1 for k in aux if not 1 <= k <= target.num_hidden_layers]
    if bad:
        raise DsparkError(f"{src}: target_layer_ids entry {bad[0]} is outside the target's "
                          f"{target.num_hidden_layers} layers")
    t_hidden = int(raw.get("target_hidden_size") or raw["hidden_size"])
    if t_hidden != target.hidden_size:
        raise DsparkError(f"{src}: target_hidden_size {t_hidden} differs from the target's hidden_size "
                          f"{target.hidden_size}")
    if layers.vocab_size < target.vocab_size:
        raise DsparkError(f"{src}: vocab_size {layers.vocab_size} is smaller than the target's "
                          f"{target.vocab_size} (the draft embeds target token ids)")
    draft_vocab = int(raw.get("draft_vocab_size") or layers.vocab_size)
    if draft_vocab > target.vocab_size:
        raise DsparkError(f"{src}: draft_vocab_size {draft_vocab} is larger than the target's vocab_size "
                          f"{target.vocab_size} (padded draft vocabularies are not supported)")
    mask = _nested(raw, "mask_token_id")
    for alias in ("dspark_noise_token_id", "pard_token", "ptd_token_id"):
        if mask is None and raw.get(alias) is not None:
            mask = raw[alias]
    if mask is None:
        raise DsparkError(f"{src}: no mask token: set dflash_config.mask_token_id")
    if not 0 <= int(mask) < layers.vocab_size:
        raise DsparkError(f"{src}: mask_token_id {mask} is outside the draft vocabulary of {layers.vocab_size}")
    causal = raw.get("is_causal")
    if causal is None:
        causal = (raw.get("dflash_config") or {}).get("causal", False)
    if raw.get("markov_rank") is None:
        raise DsparkError(f"{src}: markov_rank is missing")
    n = raw.get("block_size") or raw.get("dspark_block_size")
    if not n or int(n) < 1:
        raise DsparkError(f"{src}: block_size (draft tokens per step) is missing or < 1")
    topk = raw.get("dspark_draft_topk")
    if topk is not None and not 1 <= int(topk) <= draft_vocab:
        raise DsparkError(f"{src}: dspark_draft_topk {topk} must be between 1 and draft_vocab_size {draft_vocab}")
    v_scale = (raw.get("dflash_config") or {}).get("attention_value_scale")
    return DsparkConfig(
        layers=layers, aux_layers=aux, target_hidden_size=t_hidden, mask_token_id=int(mask),
        causal=bool(causal), markov_rank=int(raw["markov_rank"]), draft_vocab_size=draft_vocab,
        num_draft=int(n), sample_from_anchor=bool(raw.get("sample_from_anchor", True)),
        enable_confidence_head=bool(raw.get("enable_confidence_head", False)),
        confidence_head_with_markov=bool(raw.get("confidence_head_with_markov", False)),
        draft_topk=None if topk is None else int(topk), logit_scale=float(raw.get("logit_scale", 1.0)),
        v_scale=None if v_scale is None else float(v_scale), raw=raw)


def load_dspark_config(draft_dir: str | Path, target: ModelConfig) -> DsparkConfig:
    d = Path(draft_dir)
    raw, path = read_config_json(d, "a DSpark draft directory")
    if (d / MASK_EMBEDDING_FILE).is_file():
        raise DsparkError(f"{d / MASK_EMBEDDING_FILE}: a separate mask embedding is not supported")
    return dspark_config_from_dict(raw, target, src=str(path))
