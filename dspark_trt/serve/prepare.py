"""Request body -> token ids and generation configs. CPU work: the server runs it in a worker thread.

Every check that can refuse a request is here, each as an OpenAIError naming the field:
- the body: JSON (no NaN/Infinity, nesting too deep is refused, not a crash), an object, no lone UTF-16
  surrogate in any string ("\\ud800" parses as JSON but is not text);
- the fields (protocol.py), the model name, the spec against the artifact's max draft length;
- the prompt: encodable, non-empty, shorter than the context;
- max_tokens: prompt + max_tokens must fit the context (400 naming the field, as vLLM answers); unset, it is
  16 for completions (OpenAI's default) and the rest of the context for chat, clamped to what the context
  has left (such a completion may finish with finish_reason "length" at the context end).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from dspark_trt.errors import DsparkError
from dspark_trt.serve.protocol import (DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, OpenAIError,
                                       validation_message)

_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass
class Prepared:
    """What a validated request submits: one prompt (ids) and one config per choice."""

    body: object
    ids_list: list
    configs: list

    @property
    def prompt_tokens(self) -> int:
        return sum(len(i) for i in self.ids_list)


def _reject_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def parse_json(raw: bytes) -> dict:
    """The request body as a JSON object, or a 400."""
    if not raw.strip():
        raise OpenAIError(400, "request body is required: a JSON object")
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except RecursionError:
        raise OpenAIError(400, "request body is not valid JSON: nested too deeply") from None
    except UnicodeDecodeError as e:
        raise OpenAIError(400, f"request body is not valid UTF-8: {e.reason} at byte {e.start}") from None
    except ValueError as e:
        raise OpenAIError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "request body must be a JSON object")
    where = find_surrogate(data)
    if where is not None:
        raise OpenAIError(400, f"{where or 'a field name'}: contains a lone UTF-16 surrogate (e.g. \\ud800), "
                          "which is not valid text", param=where or None)
    return data


def find_surrogate(obj, path: str = "") -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate; None if there is none."""
    stack = [(obj, path)]
    while stack:
        x, p = stack.pop()
        if isinstance(x, str):
            if not x.isascii() and _SURROGATE.search(x):
                return p
        elif isinstance(x, dict):
            for k, v in x.items():
                if not k.isascii() and _SURROGATE.search(k):
                    return p
                stack.append((v, f"{p}.{k}" if p else k))
        elif isinstance(x, list):
            stack.extend((v, f"{p}.{i}") for i, v in enumerate(x))
    return None


def parse_body(raw: bytes, model_cls):
    from pydantic import ValidationError

    data = parse_json(raw)
    try:
        return model_cls.model_validate(data)
    except ValidationError as e:
        message, param = validation_message(list(e.errors(include_url=False)))
        raise OpenAIError(400, message, param=param) from None


def encode_text(rt, text: str) -> list[int]:
    """Token ids of `text`, with the tokenizer releasing the GIL where it can (a long prompt must not stall
    the event loop's thread while it tokenizes)."""
    tok = rt.tokenizer
    encode = getattr(tok, "encode_released", None) or tok.encode
    return encode(text)


def check_prompt(rt, ids: list[int], param: str = "prompt") -> list[int]:
    if not ids:
        raise OpenAIError(400, "prompt encodes to no tokens", param=param)
    if len(ids) >= rt.max_context:
        raise OpenAIError(400, f"prompt has {len(ids)} tokens; this model's maximum context length is "
                          f"{rt.max_context} tokens", param=param, code="context_length_exceeded")
    return ids


def max_new_tokens(requested: int | None, field: str, prompt_len: int, max_context: int,
                   default: int | None) -> int:
    """The max_tokens rule (module docstring). prompt_len < max_context already holds."""
    room = max_context - prompt_len
    if requested is None:
        return room if default is None else max(1, min(default, room))
    if prompt_len + requested > max_context:
        raise OpenAIError(400, f"this model's maximum context length is {max_context} tokens; this request "
                          f"asked for {prompt_len + requested} ({prompt_len} in the prompt, {requested} for the "
                          f"completion): lower {field} to at most {room}", param=field,
                          code="context_length_exceeded")
    return requested


def _common(body, rt, name: str) -> None:
    body.check_supported()
    if body.model is not None and body.model != name:
        raise OpenAIError(404, f"the model `{body.model}` does not exist; this server serves `{name}`",
                          param="model", code="model_not_found")
    from dspark_trt.runtime.config import parse_spec

    try:
        parse_spec(body.spec, rt.max_draft, getattr(rt, "draft_limit", None))
    except DsparkError as e:
        raise OpenAIError(400, str(e), param="spec") from None


def _configs(body, rt, ids_list, default: int | None) -> list:
    from dspark_trt.runtime.config import GenerationConfig

    temperature = 1.0 if body.temperature is None else float(body.temperature)
    seed = body.seed if body.seed is not None else (secrets.randbits(31) if temperature > 0 else 0)
    requested, field = body.requested_max_tokens()
    return [GenerationConfig(max_new_tokens=max_new_tokens(requested, field, len(ids), rt.max_context, default),
                             temperature=temperature, spec=body.spec, seed=int(seed), stop=body.stop_list(),
                             stop_at_eos=not body.ignore_eos)
            for ids in ids_list]


def prepare_completion(raw: bytes, rt, name: str, max_prompts: int) -> Prepared:
    body = parse_body(raw, CompletionRequest)
    _common(body, rt, name)
    prompts = body.prompts()
    if len(prompts) > max_prompts:
        raise OpenAIError(400, f"at most {max_prompts} prompts per request, got {len(prompts)}", param="prompt")
    ids_list = []
    for p in prompts:
        try:
            ids = encode_text(rt, p) if isinstance(p, str) else rt.encode(p)
        except DsparkError as e:
            raise OpenAIError(400, str(e), param="prompt") from None
        ids_list.append(check_prompt(rt, ids))
    return Prepared(body, ids_list, _configs(body, rt, ids_list, DEFAULT_MAX_TOKENS))


def prepare_chat(raw: bytes, rt, name: str, template) -> Prepared:
    body = parse_body(raw, ChatCompletionRequest)
    _common(body, rt, name)
    text = template.render(body.plain_messages())
    ids = check_prompt(rt, encode_text(rt, text), param="messages")
    return Prepared(body, [ids], _configs(body, rt, [ids], None))
