"""Chat messages -> prompt text: the artifact's chat template, else a documented plain one.

Where the template comes from, first found wins:
1. `chat_template.jinja` in the artifact directory (newer Hugging Face layout);
2. `chat_template` in the artifact's `tokenizer_config.json` (a string, or a list of {name, template}: the
   one named "default");
3. the plain template: one line `role: content` per message, then `assistant:` to prompt the reply.

A Jinja template renders as Hugging Face renders it (sandboxed Jinja2, trim_blocks and lstrip_blocks,
`raise_exception`, `tojson`, `strftime_now`; variables `messages`, `add_generation_prompt=True` and the
special tokens of tokenizer_config.json). Jinja2 is an optional dependency (the `serve` extra installs it):
without it the server logs a warning at start-up and uses the plain template.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path

from dspark_trt.errors import DsparkError
from dspark_trt.serve.protocol import OpenAIError

log = logging.getLogger("dspark_trt.serve")

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def render_plain(messages: list[dict]) -> str:
    """The plain template: `role: content` lines, then `assistant:` (no trailing space or newline)."""
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # an AddedToken written out: {"content": "<s>", ...}
        v = v.get("content")
    return v if isinstance(v, str) else None


def find_template(artifact_dir) -> tuple[str | None, str, dict]:
    """(template source or None, where it came from, tokenizer_config.json as a dict)."""
    base = Path(artifact_dir)
    config: dict = {}
    cfg_path = base / "tokenizer_config.json"
    if cfg_path.is_file():
        try:
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise DsparkError(f"{cfg_path} is not valid JSON ({e}); fix or remove it") from None
        if not isinstance(config, dict):
            raise DsparkError(f"{cfg_path} must hold a JSON object")
    jinja_path = base / "chat_template.jinja"
    if jinja_path.is_file():
        return jinja_path.read_text(encoding="utf-8"), jinja_path.name, config
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if isinstance(tpl, str) and tpl.strip():
        return tpl, "tokenizer_config.json", config
    return None, "plain", config


class ChatTemplate:
    """Renders a list of {"role", "content"} messages to the prompt text."""

    def __init__(self, source: str | None = None, origin: str = "plain", special_tokens: dict | None = None):
        self.origin = origin
        self.special = dict(special_tokens or {})
        self._template = None
        if source is not None:
            try:
                self._template = _compile(source)
            except ImportError:
                log.warning("the artifact's chat template (%s) needs jinja2, which is not installed "
                            "(pip install 'dspark-trt[serve]'): using the plain template", origin)
                self.origin = "plain (jinja2 missing)"
            except Exception as e:  # jinja2.TemplateSyntaxError and kin
                raise DsparkError(f"the chat template in {origin} does not compile: {e}") from None

    @classmethod
    def for_artifact(cls, artifact_dir) -> "ChatTemplate":
        source, origin, config = find_template(artifact_dir)
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        return cls(source, origin, special)

    @property
    def plain(self) -> bool:
        return self._template is None

    def render(self, messages: list[dict]) -> str:
        if self._template is None:
            return render_plain(messages)
        try:
            text = self._template.render(messages=messages, add_generation_prompt=True, tools=None,
                                         **self.special)
        except Exception as e:  # raise_exception() in the template, or a template bug these messages hit
            raise OpenAIError(400, f"the chat template refused these messages: {e}", param="messages") from None
        return text


def _compile(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
