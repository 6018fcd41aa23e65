"""Peer baselines at batch 1 with Hugging Face transformers on the same checkpoint pair.

- ``hf:target``: plain target decoding, ``model.generate(input_ids, do_sample=False, max_new_tokens=N)``.
- ``hf:assisted``: assisted generation, ``model.generate(..., assistant_model=draft)`` with transformers'
  own dynamic draft length (its defaults: up to ``num_assistant_tokens`` drafts per round, cut early when
  the assistant's confidence falls below ``assistant_confidence_threshold``, which it adapts over calls).

Both see exactly the benchmark's prompt token ids and generate exactly ``max_new_tokens`` tokens (EOS is
disabled, as in the runtime runs), one prompt at a time. torch and transformers are imported lazily here;
the rest of the package never needs them.
"""

from __future__ import annotations

import time
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.manifest_schema import MODEL_DTYPE_TO_ONNX

PEER_MODES = ("hf:target", "hf:assisted")
PEER_LABELS = {"hf:target": "transformers generate (target only)",
               "hf:assisted": "transformers assisted generation (draft as assistant_model)"}


def _import():
    try:
        import torch
        import transformers
    except ImportError as e:  # pragma: no cover - depends on the install
        raise DsparkError(f"--peers needs torch and transformers ({e}); install them, e.g. "
                          f"`pip install torch transformers`") from None
    return torch, transformers


def load_pair(target_dir, draft_dir, dtype: str = "fp32", device: str = "auto"):
    """(target, draft, device) as eval-mode AutoModelForCausalLM with EOS disabled in their generation
    configs (so generate() always produces max_new_tokens tokens)."""
    torch, transformers = _import()
    from transformers import AutoModelForCausalLM

    for name, d in (("target", target_dir), ("draft", draft_dir)):
        if not d or not (Path(d) / "config.json").is_file():
            raise DsparkError(f"--peers needs the {name} checkpoint in HF layout; the manifest's "
                              f"sources.{name} ({d!r}) has no config.json: re-export from an existing directory")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    # Half precision matmuls on CPU are slow or missing: peers on CPU run in fp32 (as the ORT CPU backend).
    tdtype = getattr(torch, MODEL_DTYPE_TO_ONNX.get(dtype, "float32")) if device != "cpu" else torch.float32
    transformers.utils.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:  # pragma: no cover - older transformers
        pass
    models = []
    for d in (target_dir, draft_dir):
        try:
            m = AutoModelForCausalLM.from_pretrained(str(d), dtype=tdtype)
        except TypeError:  # pragma: no cover - transformers < 4.56 spells it torch_dtype
            m = AutoModelForCausalLM.from_pretrained(str(d), torch_dtype=tdtype)
        m = m.to(device).eval()
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
        models.append(m)
    return models[0], models[1], device


def generate_one(target, ids: list[int], max_new_tokens: int, temperature: float = 0.0, seed: int = 0,
                 assistant=None) -> list[int]:
    """One prompt through transformers generate (plain, or assisted when ``assistant`` is given)."""
    torch, _ = _import()
    from transformers import GenerationConfig

    device = next(target.parameters()).device
    x = torch.tensor([list(ids)], dtype=torch.long, device=device)
    kw = dict(max_new_tokens=int(max_new_tokens), min_new_tokens=0, eos_token_id=None, pad_token_id=0)
    if temperature > 0:
        cfg = GenerationConfig(do_sample=True, temperature=float(temperature), top_k=0, top_p=1.0, **kw)
        torch.manual_seed(int(seed))
    else:
        cfg = GenerationConfig(do_sample=False, **kw)
    with torch.inference_mode():
        out = target.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg,
                              **({"assistant_model": assistant} if assistant is not None else {}))
    return out[0, x.shape[1]:].tolist()


def assistant_settings(draft) -> dict:
    """The assistant's effective draft-length settings (its generation config, else transformers' defaults;
    after a run they hold the values transformers adapted, e.g. the confidence threshold)."""
    g = draft.generation_config
    try:
        defaults = g._get_default_generation_params()
    except AttributeError:  # pragma: no cover - other transformers versions
        defaults = {}
    out = {}
    for k in ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold"):
        v = getattr(g, k, None)
        out[k] = v if v is not None else defaults.get(k)
    return out


def run_peers(target_dir, draft_dir, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
              seed: int = 0, dtype: str = "fp32", device: str = "auto", modes=PEER_MODES, bar=None) -> list[dict]:
    """Run each peer over ``prompts`` (token-id lists) at batch 1, one prompt after another.

    Returns one dict per mode: ``mode``, ``label``, ``device``, ``threads``, ``wall_s`` and per request
    ``requests``: ``[{"token_ids", "generated_tokens", "latency_s"}]`` (no TTFT: generate() is not
    streamed), plus the assistant's settings for ``hf:assisted``. ``bar`` (a tqdm) advances per request.
    """
    torch, transformers = _import()
    target, draft, device = load_pair(target_dir, draft_dir, dtype, device)
    rows = []
    for mode in modes:
        if mode not in PEER_MODES:
            raise ValueError(f"unknown peer mode {mode!r}")
        assistant = draft if mode == "hf:assisted" else None
        # Warm-up (allocator, kernels, the assistant's first adaptive threshold update) outside the timing.
        generate_one(target, prompts[0], min(4, max_new_tokens), temperature, seed, assistant)
        reqs = []
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            s = time.perf_counter()
            toks = generate_one(target, ids, max_new_tokens, temperature, seed + i, assistant)
            if device == "cuda":
                torch.cuda.synchronize()
            reqs.append({"token_ids": toks, "generated_tokens": len(toks), "latency_s": time.perf_counter() - s})
            if bar is not None:
                bar.update(1)
        row = {"mode": mode, "label": PEER_LABELS[mode], "device": device, "threads": torch.get_num_threads(),
               "transformers": transformers.__version__, "torch": torch.__version__,
               "wall_s": time.perf_counter() - t0, "requests": reqs}
        if assistant is not None:
            row["assistant"] = assistant_settings(draft)
        rows.append(row)
    return rows
