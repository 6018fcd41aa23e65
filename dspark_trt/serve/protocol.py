"""OpenAI protocol: the request bodies of /v1/completions and /v1/chat/completions, and error bodies.

Fields the runtime cannot honour are rejected with a 400 naming the field (never silently ignored): n/best_of
other than 1, echo, logprobs, suffix, penalties, logit_bias, top_p other than 1, tools, a response_format
other than text. Unknown extra fields are ignored, as newer clients send fields older servers lack.
Integers are strict (1e30, 2.5, "16" and true are not a max_tokens); `seed` is 0..2**64-1; `spec` (a
dspark extension: off | fixed:K | adaptive) is checked for syntax here and against the artifact later;
`ignore_eos` (vLLM's extension) keeps generating past the end-of-sequence token up to max_tokens.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions (chat defaults to what the context has left)
MAX_STOPS = 16
MAX_SEED = 2 ** 64 - 1

Number = Union[StrictInt, StrictFloat]


class OpenAIError(Exception):
    """An error answered with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = False


class _Sampling(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="allow")

    model: Optional[StrictStr] = Field(default=None, max_length=256)
    max_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    temperature: Optional[Number] = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Optional[Number] = Field(default=None, gt=0.0, le=1.0)
    n: Optional[StrictInt] = Field(default=1, ge=1)
    seed: Optional[StrictInt] = Field(default=None, ge=0, le=MAX_SEED)
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[Number] = 0.0
    frequency_penalty: Optional[Number] = 0.0
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[StrictStr] = None
    spec: StrictStr = Field(default="adaptive", max_length=32)
    ignore_eos: StrictBool = False

    @field_validator("spec")
    @classmethod
    def _spec_syntax(cls, v: str) -> str:
        from dspark_trt.errors import DsparkError
        from dspark_trt.runtime.config import spec_syntax

        try:
            spec_syntax(v)
        except DsparkError as e:
            raise ValueError(str(e)) from None
        return v

    @field_validator("stop")
    @classmethod
    def _few_stops(cls, v):
        if isinstance(v, list) and len(v) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings, got {len(v)}")
        return v

    def _unsupported(self) -> list[tuple[str, bool, str]]:
        return [
            ("n", self.n not in (None, 1), "only n=1 is supported; send several requests for several completions"),
            ("presence_penalty", bool(self.presence_penalty), "presence_penalty is not supported"),
            ("frequency_penalty", bool(self.frequency_penalty), "frequency_penalty is not supported"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("top_p", self.top_p not in (None, 1.0), "only top_p=1 is supported"),
        ]

    def check_supported(self) -> None:
        """Raise OpenAIError(400) for a field set to a value the runtime does not implement."""
        for param, bad, message in self._unsupported():
            if bad:
                raise OpenAIError(400, message, param=param)

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        """(the max_tokens the client set or None, the field it set it in)."""
        return self.max_tokens, "max_tokens"

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """The body of POST /v1/completions."""

    prompt: Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]
    best_of: Optional[StrictInt] = None
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None

    def _unsupported(self):
        return super()._unsupported() + [
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
            ("echo", bool(self.echo), "echo is not supported"),
            ("logprobs", self.logprobs is not None, "logprobs are not supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
        ]

    def prompts(self) -> list:
        """The prompts as a list: strings or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            out = [p]
        elif p and isinstance(p[0], int):
            out = [p]
        else:
            out = list(p)
        if not out:
            raise OpenAIError(400, "prompt must not be empty", param="prompt")
        for x in out:
            if len(x) == 0:
                raise OpenAIError(400, "prompt must not be empty", param="prompt")
        return out


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: Optional[StrictStr] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(_Sampling):
    """The body of POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    response_format: Optional[dict[str, Any]] = None

    def _unsupported(self):
        fmt = (self.response_format or {}).get("type", "text")
        return super()._unsupported() + [
            ("logprobs", bool(self.logprobs), "logprobs are not supported"),
            ("top_logprobs", self.top_logprobs is not None, "top_logprobs are not supported"),
            ("tools", bool(self.tools), "tools are not supported"),
            ("tool_choice", self.tool_choice not in (None, "none"), "tool_choice is not supported"),
            ("response_format", fmt != "text", f"response_format {fmt!r} is not supported (only text)"),
        ]

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def plain_messages(self) -> list[dict]:
        """[{"role", "content"}] with text content; a non-text content part is a 400 naming it."""
        out = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise OpenAIError(400, f"content part of type {part.type!r} is not supported (only text)",
                                          param=f"messages.{i}.content.{j}.type")
                    texts.append(part.text)
                content = "\n".join(texts)
            msg = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            if m.name:
                msg["name"] = m.name
            out.append(msg)
        return out


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Pydantic validation errors -> (one-line message, OpenAI `param`)."""
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    # Union members add their type name to the location (prompt.str, prompt.list[int]...): drop those.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")
           and not x.startswith(("constrained-", "function-"))]
    kind = e.get("type", "")
    if kind == "missing" and not loc:
        return "request body is required: a JSON object", None
    if kind in ("model_attributes_type", "dict_type", "model_type") and not loc:
        return "request body must be a JSON object", None
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, "):]
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param
