"""A hostile but realistic client's requests: a fixed corpus (every case found by hand against `kvflow serve`) and
seeded mutants of valid requests. Each case says what the server must answer: an exact status, or "any 4xx", or 200
where a numerically awkward but valid request must simply be served."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

MODEL = "tiny"
KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@dataclass(slots=True)
class Case:
    name: str
    path: str
    body: bytes | None
    expect: int | str                 # an HTTP status, or "4xx"
    headers: dict = field(default_factory=lambda: dict(AUTH))
    method: str = "POST"
    raw: bool = False                 # sent over a plain socket: clients such as httpx refuse to send it


def completion(**kw) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2, "temperature": 0, **kw}


def chat(**kw) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def _j(obj) -> bytes:
    return json.dumps(obj).encode()


def _nested(n: int, where: str) -> bytes:
    deep = "[" * n + "]" * n
    if where == "prompt":
        return f'{{"model": "{MODEL}", "prompt": {deep}, "max_tokens": 2}}'.encode()
    return f'{{"model": "{MODEL}", "prompt": "hi", "max_tokens": 2, "stream_options": {{"a": {deep}}}}}'.encode()


def fixed() -> list[Case]:
    C, H = "/v1/completions", "/v1/chat/completions"
    cases = [
        # a lone UTF-16 surrogate anywhere a string goes
        Case("surrogate in prompt", C, _j(completion(prompt="a\ud800b")), 400),
        Case("surrogate in prompt list", C, _j(completion(prompt=["ok", "\udfff"])), 400),
        Case("surrogate in chat message", H, _j(chat(messages=[{"role": "user", "content": "\ud800"}])), 400),
        Case("surrogate in content part", H, _j(chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "x\ud800"}]}])), 400),
        Case("surrogate in stop", C, _j(completion(stop=["\ud800"])), 400),
        Case("surrogate in a key", C, _j({**completion(), "\ud800": 1}), 400),
        Case("surrogate in model", C, _j(completion(model="\ud800")), 400),
        # nesting
        *[Case(f"nested {n} in {w}", C, _nested(n, w), 400) for n in (40, 5_000, 100_000)
          for w in ("prompt", "stream_options")],
        Case("nested 20 in stream_options is fine", C, _nested(20, "stream_options"), 200),
        # content parts
        *[Case(f"content part text {v!r}", H, _j(chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": v}]}])), 400) for v in (5, [1], None, {"a": 1}, True)],
        Case("content part without text", H, _j(chat(messages=[{"role": "user", "content": [{"type": "text"}]}])),
             400),
        Case("image content part", H, _j(chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}])), 400),
        Case("content part not an object", H, _j(chat(messages=[{"role": "user", "content": ["hi"]}])), 400),
        Case("content an int", H, _j(chat(messages=[{"role": "user", "content": 5}])), 400),
        Case("content an object", H, _j(chat(messages=[{"role": "user", "content": {"text": "hi"}}])), 400),
        Case("text parts are served", H, _j(chat(messages=[{"role": "user", "content": [
            {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}])), 200),
        # numerically awkward sampling: served, never a failed step
        Case("temperature 1e-300", C, _j(completion(temperature=1e-300)), 200),
        Case("temperature 5e-324", C, _j(completion(temperature=5e-324)), 200),
        Case("temperature 100 top_p 1e-300", C, _j(completion(temperature=100, top_p=1e-300)), 200),
        Case("temperature 1e-300 top_p 1e-300", H, _j(chat(temperature=1e-300, top_p=1e-300)), 200),
        Case("top_k past the vocabulary", C, _j(completion(temperature=1, top_k=10**12)), 200),
        Case("temperature NaN literal", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400),
        Case("temperature Infinity literal", C, b'{"model": "tiny", "prompt": "hi", "temperature": Infinity}', 400),
        Case("top_p -Infinity", C, b'{"model": "tiny", "prompt": "hi", "top_p": -Infinity}', 400),
        Case("seed 2^63", C, _j(completion(temperature=1, seed=2**63)), 400),
        Case("seed -1", C, _j(completion(temperature=1, seed=-1)), 400),
        # counts and sizes
        Case("10,000 chat messages", H, _j(chat(messages=[{"role": "user", "content": "hi"}] * 10_000)), 400),
        Case("2,000 prompts", C, _j(completion(prompt=["hi"] * 2_000)), 400),
        Case("prompt + max_tokens over the context", C, _j(completion(max_tokens=10**9)), 400),
        Case("max_tokens 2^70", C, _j(completion(max_tokens=2**70)), 400),
        Case("8 MB prompt string", C, _j(completion(prompt="x" * (8 << 20))), 400),
        Case("40 MB body", C, _j(completion(prompt="x" * (40 << 20))), 413),
        Case("8 prompts are served", C, _j(completion(prompt=["a", "b", "c", "d", "e", "f", "g", "h"])), 200),
        # types: booleans are not integers, strings are not numbers
        Case("max_tokens '5'", C, _j(completion(max_tokens="5")), 400),
        Case("max_tokens true", C, _j(completion(max_tokens=True)), 400),
        Case("max_tokens 5.0", C, _j(completion(max_tokens=5.0)), 400),
        Case("max_tokens 0", C, _j(completion(max_tokens=0)), 400),
        Case("max_tokens -1", C, _j(completion(max_tokens=-1)), 400),
        Case("prompt [true]", C, _j(completion(prompt=[True])), 400),
        Case("prompt [1, true]", C, _j(completion(prompt=[1, True])), 400),
        Case("prompt [[true]]", C, _j(completion(prompt=[[True]])), 400),
        Case("temperature '0'", C, _j(completion(temperature="0")), 400),
        Case("temperature true", C, _j(completion(temperature=True)), 400),
        Case("stream 'yes'", C, _j(completion(stream="yes")), 400),
        Case("ignore_eos 1", C, _j(completion(ignore_eos=1)), 400),
        Case("n true", C, _j(completion(n=True)), 400),
        Case("n 2", C, _j(completion(n=2)), 400),
        Case("model 5", C, _j(completion(model=5)), 400),
        Case("unknown model", C, _j(completion(model="gpt-9")), 404),
        Case("stop 17 strings", C, _j(completion(stop=[str(i) for i in range(17)])), 400),
        Case("stop empty string", C, _j(completion(stop="")), 400),
        Case("stop_token_ids [-1]", C, _j(completion(stop_token_ids=[-1])), 400),
        Case("stream_options a list", C, _j(completion(stream_options=[1])), 400),
        Case("token ids past the vocabulary", C, _j(completion(prompt=[1, 10**6])), 400),
        Case("negative token id", C, _j(completion(prompt=[-1])), 400),
        Case("token id 2^70", C, _j(completion(prompt=[2**70])), 400),
        Case("empty prompt", C, _j(completion(prompt="")), 400),
        Case("empty prompt list", C, _j(completion(prompt=[])), 400),
        Case("empty inner prompt", C, _j(completion(prompt=[[]])), 400),
        Case("echo", C, _j(completion(echo=True)), 400),
        Case("logprobs", C, _j(completion(logprobs=2)), 400),
        Case("stream with two prompts", C, _j(completion(prompt=["a", "b"], stream=True)), 400),
        Case("no messages", H, _j(chat(messages=[])), 400),
        Case("messages an object", H, _j(chat(messages={"role": "user"})), 400),
        Case("unknown role", H, _j(chat(messages=[{"role": "wizard", "content": "x"}])), 400),
        Case("message without role", H, _j(chat(messages=[{"content": "x"}])), 400),
        Case("chat logprobs", H, _j(chat(logprobs=True)), 400),
        Case("chat max_completion_tokens '3'", H, _j(chat(max_completion_tokens="3")), 400),
        # bodies
        Case("empty body", C, b"", 400),
        Case("not JSON", C, b"{nope", 400),
        Case("JSON list", C, b"[1, 2]", 400),
        Case("JSON string", C, b'"hi"', 400),
        Case("JSON null", C, b"null", 400),
        Case("truncated JSON", C, _j(completion())[:-3], 400),
        Case("UTF-16 body", C, json.dumps(completion()).encode("utf-16"), 400),
        Case("UTF-16-LE body without BOM", C, json.dumps(completion()).encode("utf-16-le"), 400),
        Case("UTF-8 BOM", C, b"\xef\xbb\xbf" + _j(completion()), 400),
        Case("invalid UTF-8", C, b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
        Case("missing model", C, _j({"prompt": "hi"}), 400),
        Case("missing prompt", C, _j({"model": MODEL}), 400),
        # routes, methods, keys
        Case("unknown route", "/v1/nothing", _j(completion()), 404),
        Case("unknown route, made-up path", "/" + "x" * 200, None, 404, method="GET"),
        Case("GET on completions", C, None, 405, method="GET"),
        Case("no API key", C, _j(completion()), 401, headers={}),
        Case("wrong API key", C, _j(completion()), 401, headers={"Authorization": "Bearer nope"}),
        Case("key without scheme", C, _j(completion()), 401, headers={"Authorization": KEY}),
        Case("basic scheme", C, _j(completion()), 401, headers={"Authorization": f"Basic {KEY}"}),
        Case("key with a trailing space", C, _j(completion()), 200, headers={"Authorization": f"Bearer {KEY} "},
             raw=True),
        Case("lower-case scheme", C, _j(completion()), 200, headers={"Authorization": f"bearer {KEY}"}),
        Case("models without a key", "/v1/models", None, 401, headers={}, method="GET"),
        Case("health without a key", "/health", None, 200, headers={}, method="GET"),
    ]
    return cases


NASTY = [None, True, False, 0, -1, 1, 2**31, 2**64, -2**64, 1e308, -1e308, 1e-300, 0.5, "", "x", "5", "\u0000",
         "\ufffd" * 3, "x" * 10_000, [], [None], [1, "a"], [[1, 2], [3]], {}, {"a": None}, [[[[[[1]]]]]],
         {"type": "text", "text": 1}, [{"type": "text", "text": None}], ["\u00e9"] * 3]
FIELDS = ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
          "ignore_eos", "n", "stream", "stream_options", "echo", "logprobs"]
CHAT_FIELDS = ["messages", "max_completion_tokens", "logprobs", "temperature", "stop", "model"]


def mutants(count: int, seed: int = 0) -> list[Case]:
    """Valid requests with one to three fields replaced by NASTY values (or messages' fields, for chat): the server
    must answer each with a 200 or a 4xx JSON error, never a 5xx."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if rng.random() < 0.6:
            body, path = completion(), "/v1/completions"
            for name in rng.sample(FIELDS, rng.randint(1, 3)):
                body[name] = rng.choice(NASTY)
        else:
            body, path = chat(), "/v1/chat/completions"
            for name in rng.sample(CHAT_FIELDS, rng.randint(1, 2)):
                if name == "messages" and rng.random() < 0.6:
                    body[name] = [{"role": rng.choice(["user", "system", "x", None]), "content": rng.choice(NASTY)}]
                else:
                    body[name] = rng.choice(NASTY)
        if body.get("stream") is True:
            body["stream"] = False           # keep the whole answer one JSON document
        out.append(Case(f"mutant {i}", path, json.dumps(body).encode(), "any"))
    return out
