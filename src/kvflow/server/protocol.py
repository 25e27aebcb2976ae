"""OpenAI request bodies: from raw bytes to a typed request, or an ``APIError`` (a 4xx) — nothing in between raises
anything else. Unknown fields are ignored, as OpenAI's servers do; extensions, as in vLLM: ``top_k``,
``stop_token_ids``, ``ignore_eos``, token-id prompts, ``POST /tokenize`` and ``/detokenize``.

What real clients send is accepted (docs/ENGINE.md, "Clients"): ``null`` for an optional field means its default
(the OpenAI spec makes them nullable); the sampling fields this engine does not implement are accepted at their
neutral value (``repetition_penalty`` 1, ``presence_penalty`` / ``frequency_penalty`` / ``min_p`` / ``min_tokens``
0, empty ``logit_bias``, no ``tools``, ``response_format`` text) and any other value is a 400 naming the field —
never silently ignored.

What a body must be (each rule is a 400 or 413 naming the field; docs/ENGINE.md, "Requests"):

    bytes    at most ``server.max_body_bytes`` (413), UTF-8 (RFC 8259: a UTF-16 body is refused)
    JSON     one object, nested at most ``server.max_json_depth`` deep, every string valid Unicode (no lone
             surrogate such as "\\ud800": it cannot become UTF-8 or tokens)
    fields   strictly typed: a boolean is not a number, "5" is not an integer, 5.0 is not an integer (an integer
             is a number); chat content is a string or a list of {"type": "text", "text": str} parts
    counts   at most ``server.max_messages`` chat messages, ``server.max_prompts`` prompts per completion request
"""

from __future__ import annotations

import json
from typing import Any, Literal, Union

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvflow.engine import SamplingParams
from kvflow.server.limits import ServerLimits


class APIError(Exception):
    """An OpenAI-style error answer: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        message, param = _printable(message), None if param is None else _printable(param)
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class _Base(_Strict):
    """The fields both routes share. ``None`` given for any of them means "not given" (``_nulls_are_defaults``)."""
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    user: str | None = None
    # accepted at their neutral value only (``unsupported``)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, body):
        if isinstance(body, dict):
            return {k: v for k, v in body.items() if v is not None or k not in cls.model_fields}
        return body

    def unsupported(self) -> tuple[str, str] | None:
        """(field, why) of the first field set to something this server does not implement."""
        neutral = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                   "min_tokens": 0}
        for name, value in neutral.items():
            if getattr(self, name) != value:
                return name, f"{name} is not supported (only {value:g}, its neutral value, is accepted)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported (only an empty one is accepted)"
        if (self.stream_options or {}).get("continuous_usage_stats"):
            return "stream_options", "stream_options.continuous_usage_stats is not supported"
        return None

    def sampling(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=default_max if self.max_tokens is None else self.max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return (self.stream_options or {}).get("include_usage") is True


class CompletionRequest(_Base):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo or self.logprobs:
            return ("echo", "echo is not supported") if self.echo else ("logprobs", "logprobs are not supported")
        if self.best_of not in (None, 1):
            return "best_of", "only best_of=1 is supported"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class ContentPart(_Strict):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content part type {self.type!r} is not supported (this server takes text parts)")
        if self.text is None:
            raise ValueError("a text content part needs a string 'text'")
        return self


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[ContentPart], None] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        if self.tools or self.tool_choice not in (None, "none", "auto"):
            return "tools", "tools and tool calls are not supported"
        if self.response_format and self.response_format.get("type") != "text":
            return "response_format", "response_format other than {\"type\": \"text\"} is not supported"
        return super().unsupported()


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's extension; its benchmark client aligns its prompts with it): a prompt or a chat."""
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' or 'messages'")
        return self


class DetokenizeRequest(_Strict):
    """``POST /detokenize``: token ids back to text."""
    model: str | None = None
    tokens: list[int]


def parse_body(raw: bytes, limits: ServerLimits) -> dict:
    """The request body (already held within ``max_body_bytes``: app.read_body) as a JSON object within ``limits``;
    APIError otherwise."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise APIError(400, f"request body is not UTF-8 (byte {err.start})") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as err:
        raise APIError(400, f"request body is not valid JSON: {err}") from None
    except RecursionError:
        raise APIError(400, f"request JSON is nested deeper than {limits.max_json_depth} levels") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object")
    _check_tree(body, limits.max_json_depth)
    return body


def too_large(limits: ServerLimits) -> APIError:
    return APIError(413, f"request body is larger than server.max_body_bytes ({limits.max_body_bytes} bytes)",
                    code="request_too_large")


def _check_tree(body: dict, max_depth: int) -> None:
    """Depth within ``max_depth`` and every string (keys too) encodable as UTF-8; iterative, so no depth can
    exhaust the stack."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, where = stack.pop()
        if depth > max_depth:
            raise APIError(400, f"request JSON is nested deeper than {max_depth} levels", param=where or None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            path = f"{where}.{key}" if where else str(key)
            if isinstance(key, str):
                _utf8(key, path)
            if isinstance(value, str):
                _utf8(value, path)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, path))


def _utf8(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise APIError(400, f"{where}: not valid Unicode (lone surrogate {text[err.start]!r} at {err.start})",
                       param=where) from None


def validate(cls, body: dict, limits: ServerLimits):
    """``cls`` (CompletionRequest or ChatRequest) from a parsed body, with the per-request counts checked."""
    if cls is ChatRequest and isinstance(body.get("messages"), list) and len(body["messages"]) > limits.max_messages:
        raise APIError(400, f"{len(body['messages'])} messages: at most server.max_messages ({limits.max_messages})",
                       param="messages")
    if (cls is CompletionRequest and isinstance(body.get("prompt"), list) and body["prompt"]
            and not isinstance(body["prompt"][0], int) and len(body["prompt"]) > limits.max_prompts):
        raise APIError(400, f"{len(body['prompt'])} prompts: at most server.max_prompts ({limits.max_prompts}) per "
                       "request", param="prompt")
    try:
        req = cls.model_validate(body)
    except ValidationError as err:
        # the deepest error says most (a union reports one per branch); union branch tags leave the path
        first = max(err.errors(), key=lambda e: len(e.get("loc", ())))
        where = ".".join(str(p) for p in first.get("loc", ()) if not _branch_tag(p))
        msg = first.get("msg", "invalid value").removeprefix("Value error, ")
        raise APIError(400, f"{where}: {msg}" if where else msg, param=where or None) from None
    refused = req.unsupported() if isinstance(req, _Base) else None
    if refused is not None:
        raise APIError(400, refused[1], param=refused[0], code="unsupported_parameter")
    return req


def _branch_tag(part) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part)


def _printable(text: str) -> str:
    """``text`` as valid UTF-8 (a lone surrogate quoted from the request becomes ``\\ud800``)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
