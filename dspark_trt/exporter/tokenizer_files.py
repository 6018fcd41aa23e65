"""What an artifact carries from the target's tokenizer side: the files, the EOS ids, special tokens and
the chat template.

Sources, as Hugging Face checkpoints lay them out:
- generation_config.json: `eos_token_id` (an int or a list: Llama 3 instruct stops at <|eot_id|> and
  <|end_of_text|>), `bos_token_id`, `pad_token_id`;
- tokenizer_config.json: `eos_token` / `bos_token` / `pad_token` (a string or {"content": ...}) and
  `chat_template` (a string, or a list of named templates);
- chat_template.jinja (newer transformers write the template there); special_tokens_map.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from dspark_trt.errors import DsparkError

COPIED = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "chat_template.jinja")
KNOWN_EOS = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|im_end|>", "<|eot_id|>")


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DsparkError(f"{path} is not valid JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _content(tok) -> str | None:
    if isinstance(tok, dict):
        tok = tok.get("content")
    return tok if isinstance(tok, str) else None


def _ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise DsparkError(f"generation_config.json: eos_token_id {value!r} must be an integer or a list of integers")
    return [int(v) for v in values]


def tokenizer_facts(model_dir: str | Path) -> dict:
    """The manifest's `tokenizer` section for a checkpoint directory (files not yet copied)."""
    d = Path(model_dir)
    vocab = {}
    tok = _json(d / "tokenizer.json")
    for t in tok.get("added_tokens", []):
        vocab[t.get("content")] = t.get("id")
    model_vocab = tok.get("model", {}).get("vocab", {})
    lookup = (lambda s: vocab.get(s, model_vocab.get(s) if isinstance(model_vocab, dict) else None))
    gen, cfg = _json(d / "generation_config.json"), _json(d / "tokenizer_config.json")

    eos = _ids(gen.get("eos_token_id"))
    name = _content(cfg.get("eos_token"))
    if not eos and name is not None and lookup(name) is not None:
        eos = [int(lookup(name))]
    if not eos:
        eos = [int(vocab[s]) for s in KNOWN_EOS if vocab.get(s) is not None][:1]
    special = {}
    for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
        s = _content(cfg.get(key))
        if s is not None:
            special[key] = {"content": s, "id": lookup(s)}
    for key in ("bos_token_id", "pad_token_id"):
        if isinstance(gen.get(key), int):
            special.setdefault(key.replace("_id", ""), {"content": None, "id": gen[key]})
    template = None
    if (d / "chat_template.jinja").is_file():
        template = {"file": "chat_template.jinja"}
    elif isinstance(cfg.get("chat_template"), (str, list)):
        template = {"file": "tokenizer_config.json", "key": "chat_template"}
    return {"file": "tokenizer.json", "eos_token_id": eos[0] if eos else None, "eos_token_ids": eos,
            "special_tokens": special, "chat_template": template,
            "files": [f for f in COPIED if (d / f).is_file()]}


def read_chat_template(artifact_dir: str | Path, tokenizer: dict) -> str | list | None:
    """The chat template an artifact carries (None when the target had none)."""
    t = tokenizer.get("chat_template")
    if not t:
        return None
    path = Path(artifact_dir) / t["file"]
    if t.get("key"):
        return _json(path).get(t["key"])
    return path.read_text()
