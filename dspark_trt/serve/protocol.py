"""OpenAI completions protocol: the request body and error bodies.

Only what `POST /v1/completions` needs. Fields the runtime cannot honour are rejected with a 400 naming the
field (never silently ignored): n/best_of other than 1, echo, logprobs, suffix, penalties, logit_bias,
top_p other than 1. Unknown extra fields are ignored, as newer clients send fields older servers lack.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
    include_usage: bool = False


class CompletionRequest(BaseModel):
    """The body of POST /v1/completions. `spec` is a dspark extension (off | fixed:K | adaptive)."""

    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(default=DEFAULT_MAX_TOKENS, ge=1)
    temperature: Optional[float] = Field(default=1.0, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(default=None, gt=0.0, le=1.0)
    n: Optional[int] = 1
    best_of: Optional[int] = None
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    echo: Optional[bool] = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    presence_penalty: Optional[float] = 0.0
    frequency_penalty: Optional[float] = 0.0
    logit_bias: Optional[dict[str, Any]] = None
    user: Optional[str] = None
    spec: str = "adaptive"

    def check_supported(self) -> None:
        """Raise OpenAIError(400) for a field set to a value the runtime does not implement."""
        unsupported = [
            ("n", self.n not in (None, 1), "only n=1 is supported; send several prompts for several completions"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
            ("echo", bool(self.echo), "echo is not supported"),
            ("logprobs", self.logprobs is not None, "logprobs are not supported"),
            ("suffix", bool(self.suffix), "suffix is not supported"),
            ("presence_penalty", bool(self.presence_penalty), "presence_penalty is not supported"),
            ("frequency_penalty", bool(self.frequency_penalty), "frequency_penalty is not supported"),
            ("logit_bias", bool(self.logit_bias), "logit_bias is not supported"),
            ("top_p", self.top_p not in (None, 1.0), "only top_p=1 is supported"),
        ]
        for param, bad, message in unsupported:
            if bad:
                raise OpenAIError(400, message, param=param)

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

    def stop_list(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [s for s in stop if s]


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """FastAPI/pydantic validation errors -> (one-line message, OpenAI `param`)."""
    if not errors:
        return "invalid request body", None
    e = errors[0]
    loc = [str(x) for x in e.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    # Union members add their type name to the location (prompt.str, prompt.list[int]...): drop those.
    loc = [x for x in loc if not any(c in x for c in "[]") and x not in ("str", "int", "float", "bool")]
    kind = e.get("type", "")
    if kind == "json_invalid":
        return f"request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg', ''))}", None
    if kind == "missing" and not loc:
        return "request body is required: a JSON object", None
    if kind in ("model_attributes_type", "dict_type") and not loc:
        return "request body must be a JSON object", None
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return (f"{param}: {msg}{more}" if param else f"{msg}{more}"), param
