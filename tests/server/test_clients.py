"""What real clients send is accepted (vLLM's benchmark client, the openai package, curl, clients that send null
for every optional field), what the engine does not implement is a 400 naming the field, and the model has the name
the operator gave it. The external clients themselves run in tests/integrations/test_vllm_bench_client.py."""

import pytest

from kvflow.server import build_app
from kvflow.server.build import check_served_name
from kvflow.errors import ConfigError
from tests.engine.helpers import hf_greedy, ids
from tests.server.helpers import MODEL, client, fail_first_step, make_app, run, sse_events


def post(app, route: str, body: dict):
    async def go():
        async with client(app) as c:
            return await c.post(route, json=body)
    return run(go())


def test_what_vllms_benchmark_client_sends_streams_exactly_the_tokens_asked_for_with_usage(tiny):
    app, _ = make_app(tiny)
    completions = {"model": MODEL, "prompt": "hello there", "repetition_penalty": 1.0, "max_tokens": 7,
                   "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
            "max_completion_tokens": 7, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    for route, body in (("/v1/completions", completions), ("/v1/chat/completions", chat)):
        r = post(app, route, body)
        assert r.status_code == 200, r.text
        events = sse_events(r.text)
        assert events[-1] == "[DONE]" and events[-2]["choices"] == []
        assert events[-2]["usage"]["completion_tokens"] == 7
        assert sum(len(e["choices"][0]["token_ids"]) for e in events[:-2] if "token_ids" in e["choices"][0]) == 7


def test_null_for_an_optional_field_means_its_default(tiny):
    app, _ = make_app(tiny)
    prompt = ids(12, 3)
    nulls = dict.fromkeys(("max_tokens", "top_p", "n", "stop", "seed", "stream", "stream_options", "logprobs",
                           "presence_penalty", "frequency_penalty", "logit_bias", "user", "suffix", "best_of"))
    r = post(app, "/v1/completions", {"model": MODEL, "prompt": prompt, "temperature": 0, **nulls})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny, prompt, 16)      # the default max_tokens
    chat = post(app, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                              "max_completion_tokens": 3, "tools": None, "tool_choice": None,
                                              "response_format": None, "top_logprobs": None, **nulls})
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
    for required in ({"model": None, "prompt": "x"}, {"model": MODEL, "prompt": None}):
        assert post(app, "/v1/completions", required).status_code == 400


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1.2), ("presence_penalty", 0.5),
                                         ("frequency_penalty", -1.0), ("min_p", 0.1), ("min_tokens", 3),
                                         ("logit_bias", {"17": 5.0}), ("best_of", 2), ("suffix", "end"),
                                         ("echo", True), ("logprobs", 1),
                                         ("stream_options", {"continuous_usage_stats": True}),
                                         ("repetition_penalty", True), ("min_tokens", "3")])
def test_a_sampling_field_the_engine_does_not_implement_is_a_400_naming_it(tiny, field, value):
    app, _ = make_app(tiny)
    r = post(app, "/v1/completions", {"model": MODEL, "prompt": "hi", field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


@pytest.mark.parametrize("field,value", [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                         ("tool_choice", "required"), ("response_format", {"type": "json_object"}),
                                         ("logprobs", True), ("top_logprobs", 2), ("presence_penalty", 1.0)])
def test_a_chat_feature_the_server_does_not_implement_is_a_400(tiny, field, value):
    app, _ = make_app(tiny)
    r = post(app, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                           field: value})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_parameter", r.text


def test_a_chat_stream_sends_nothing_before_its_first_token(tiny):
    """The role chunk goes with the first token (as vLLM's does), so a client's TTFT is the server's: a request that
    fails before any token streams its error and no role chunk."""
    app, engine = make_app(tiny)
    fail_first_step(engine)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    failed = sse_events(post(app, "/v1/chat/completions", body).text)
    assert "error" in failed[0] and failed[-1] == "[DONE]"
    ok = sse_events(post(app, "/v1/chat/completions", body).text)
    assert ok[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert ok[1]["choices"][0]["delta"]["content"] is not None and ok[1]["choices"][0]["token_ids"]


def test_tokenize_and_detokenize_round_trip_with_the_served_tokenizer(tiny):
    app, _ = make_app(tiny)
    t = post(app, "/tokenize", {"model": MODEL, "prompt": "héllo", "add_special_tokens": False}).json()
    assert t["tokens"] == list("héllo".encode()) and t["count"] == 6 and t["max_model_len"] > 0
    assert post(app, "/detokenize", {"model": MODEL, "tokens": t["tokens"]}).json() == {"prompt": "héllo"}
    chat = post(app, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] == len("<|user|>\nhi\n<|assistant|>\n")
    for route, body, status in (("/tokenize", {"model": "other", "prompt": "x"}, 404),
                                ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400),
                                ("/tokenize", {"prompt": 5}, 400),
                                ("/detokenize", {"tokens": [1, 10**9]}, 400), ("/detokenize", {"tokens": "ab"}, 400)):
        r = post(app, route, body)
        assert r.status_code == status and r.json()["error"]["message"], (body, r.text)


def test_the_served_model_name_is_the_one_clients_send_and_models_lists(tiny):
    _, engine = make_app(tiny)
    app = build_app(engine, "my-model", engine.tokenizer)

    async def go():
        async with client(app) as c:
            return (await c.get("/v1/models"), await c.post("/v1/completions", json={"model": "my-model",
                                                                                     "prompt": "x"}),
                    await c.post("/v1/completions", json={"model": MODEL, "prompt": "x"}))
    models, ok, other = run(go())
    assert [m["id"] for m in models.json()["data"]] == ["my-model"]
    assert ok.status_code == 200 and ok.json()["model"] == "my-model"
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize("name", ["", "  ", " padded", "a\nb"])
def test_a_blank_or_padded_served_model_name_is_a_config_error(name):
    with pytest.raises(ConfigError):
        check_served_name(name)
    assert check_served_name("org/model-1") == "org/model-1"
