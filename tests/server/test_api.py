"""The OpenAI-compatible API: greedy through the server equals generate (streaming or not, alone or 4 at once),
usage reports cached tokens, bad requests get OpenAI-style 4xx errors and the server keeps serving, /metrics is
valid Prometheus text."""

import asyncio

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow import KVPool, Restorer
from tests.engine.helpers import break_sampling_of_seed, hf_greedy, ids, synthetic_cost
from tests.server.helpers import MODEL, client, fail_first_step, make_app, run, sse_events


def completion(prompt, **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, **kw}


def test_greedy_completions_equal_generate_streaming_or_not_and_report_cached_tokens(tiny):
    app, _ = make_app(tiny)
    prompt = ids(40, 1)

    async def go():
        async with client(app) as c:
            plain = (await c.post("/v1/completions", json=completion(prompt))).json()
            stream = await c.post("/v1/completions", json=completion(prompt, stream=True,
                                                                       stream_options={"include_usage": True}))
            return plain, stream
    plain, stream = run(go())
    expected = hf_greedy(tiny, prompt, 6)
    assert plain["choices"][0]["token_ids"] == expected
    assert plain["usage"]["prompt_tokens"] == 40 and plain["usage"]["completion_tokens"] == 6
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert stream.headers["content-type"].startswith("text/event-stream")
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == expected
    assert "".join(e["choices"][0]["text"] for e in chunks) == plain["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32    # resident hit of 4 blocks


def test_four_concurrent_requests_are_batched_and_each_equals_generate(tiny):
    app, engine = make_app(tiny)
    prompts = [ids(n, 10 + n) for n in (9, 30, 17, 50)]

    async def go():
        async with client(app) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=completion(p, max_tokens=8))
                                          for p in prompts])
    answers = run(go())
    for prompt, r in zip(prompts, answers):
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == hf_greedy(tiny, prompt, 8)
    assert engine.stats.decode_steps_batched > 0


def test_chat_streaming_and_non_streaming_agree_on_text(tiny):
    app, _ = make_app(tiny)
    body = {"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                                         {"role": "user", "content": "hello ✓"}],
            "max_completion_tokens": 8, "temperature": 0}

    async def go():
        async with client(app) as c:
            return ((await c.post("/v1/chat/completions", json=body)).json(),
                    await c.post("/v1/chat/completions", json={**body, "stream": True}))
    plain, stream = run(go())
    events = sse_events(stream.text)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1] if e["choices"])
    assert plain["object"] == "chat.completion" and plain["choices"][0]["message"]["content"] == text
    assert plain["usage"]["completion_tokens"] == 8


BAD = [
    (b"{not json", 400),
    (b"[1, 2]", 400),
    ({"model": "nope", "prompt": "hi"}, 404),
    ({"model": MODEL}, 400),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -1}, 400),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400),
    ({"model": MODEL, "prompt": "hi", "n": 3}, 400),
    ({"model": MODEL, "prompt": []}, 400),
    ({"model": MODEL, "prompt": [1, 99999]}, 400),
    ({"model": MODEL, "prompt": "x" * 600}, 400),                       # longer than the context (512 here)
    ({"model": MODEL, "prompt": "hi", "max_tokens": 10**6}, 400),
    ({"model": MODEL, "prompt": "hi", "stop": [""]}, 400),
    ({"model": MODEL, "prompt": "hi", "temperature": 1, "seed": 2**70}, 400),
    ({"model": MODEL, "prompt": [[]]}, 400),
    ({"model": MODEL, "prompt": ["a", "b"], "stream": True}, 400),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(tiny):
    app, _ = make_app(tiny, max_model_len=512)

    async def go():
        async with client(app) as c:
            answers = []
            for body, _ in BAD:
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                answers.append(await c.post("/v1/completions", headers={"content-type": "application/json"}, **kw))
            chat_bad = await c.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
            chat_role = await c.post("/v1/chat/completions",
                                     json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]})
            ok = await c.post("/v1/completions", json=completion("still alive"))
            return answers, chat_bad, chat_role, ok
    answers, chat_bad, chat_role, ok = run(go())
    for (body, status), r in zip(BAD, answers):
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"]
    assert chat_bad.status_code == 400 and chat_role.status_code == 400
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 6


def test_an_engine_failure_answers_500_and_the_next_request_is_served(tiny):
    app, engine = make_app(tiny)
    fail_first_step(engine)

    async def go():
        async with client(app) as c:
            return (await c.post("/v1/completions", json=completion(ids(5, 1))),
                    await c.post("/v1/completions", json=completion(ids(5, 1))))
    failed, ok = run(go())
    assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == hf_greedy(tiny, ids(5, 1), 6)


def test_a_request_that_fails_inside_a_step_answers_500_alone_while_its_step_mates_are_served(tiny, monkeypatch):
    seed = break_sampling_of_seed(monkeypatch, "broken sampler")
    app, engine = make_app(tiny)

    async def go():
        async with client(app) as c:
            return await asyncio.gather(
                c.post("/v1/completions", json=completion(ids(9, 1), max_tokens=8)),
                c.post("/v1/completions", json=completion(ids(9, 2), temperature=1.0, seed=seed)),
                c.post("/v1/completions", json=completion(ids(9, 3), max_tokens=8, stream=True)))
    ok, failed, streamed = run(go())
    assert failed.status_code == 500 and "broken sampler" in failed.json()["error"]["message"]
    assert ok.status_code == 200 and ok.json()["choices"][0]["token_ids"] == hf_greedy(tiny, ids(9, 1), 8)
    chunks = [e for e in sse_events(streamed.text)[:-1] if e.get("choices")]
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == hf_greedy(tiny, ids(9, 3), 8)
    assert engine.stats.failed == 1


def test_an_api_key_guards_every_route_but_health(tiny):
    app, _ = make_app(tiny, api_key="sekrit")

    async def go():
        async with client(app) as c:
            return (await c.get("/health"), await c.get("/v1/models"),
                    await c.post("/v1/completions", json=completion("hi")),
                    await c.get("/v1/models", headers={"Authorization": "Bearer sekrit"}))
    health, models, comp, authed = run(go())
    assert health.status_code == 200 and models.status_code == 401 and comp.status_code == 401
    assert comp.json()["error"]["code"] == "invalid_api_key"
    assert authed.status_code == 200 and authed.json()["data"][0]["id"] == MODEL


def test_pool_hits_through_the_server_equal_generate_and_show_in_metrics(tiny):
    restorer = Restorer(tiny, KVPool.memory("64M", chunk_tokens=32), cost=synthetic_cost(tiny))
    base = ids(70, 3)
    restorer.store(base)
    app, engine = make_app(tiny, restorer=restorer)

    async def go():
        async with client(app) as c:
            r = await c.post("/v1/completions", json=completion(base + [5]))
            return r, (await c.get("/metrics")).text
    r, text = run(go())
    assert r.json()["choices"][0]["token_ids"] == hf_greedy(tiny, base + [5], 6)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
    families = {f.name: f for f in text_string_to_metric_families(text)}
    hits = {s.labels["source"]: s.value for s in families["kvflow_prefix_hit_tokens"].samples}
    assert hits["pool"] == 64 and hits["miss"] == 7
    for name in ("kvflow_time_to_first_token_seconds", "kvflow_inter_token_latency_seconds",
                 "kvflow_running_sequences", "kvflow_waiting_sequences", "kvflow_kv_block_usage_ratio",
                 "kvflow_pool_writes_dropped", "kvflow_restored_tokens", "kvflow_pool_blocked_io_seconds",
                 "kvflow_queue_length", "kvflow_pool_read_bandwidth_bytes_per_second"):
        assert name in families, name
    ttft = {s.name: s.value for s in families["kvflow_time_to_first_token_seconds"].samples}
    assert ttft["kvflow_time_to_first_token_seconds_count"] == 1


@pytest.mark.parametrize("route", ["/v1/models", "/health", "/metrics"])
def test_read_routes_answer(tiny, route):
    app, _ = make_app(tiny)

    async def go():
        async with client(app) as c:
            return await c.get(route)
    assert run(go()).status_code == 200


def test_several_prompts_in_one_completion_request_get_one_choice_each(tiny):
    app, _ = make_app(tiny)
    prompts = [ids(12, 21), ids(20, 22)]

    async def go():
        async with client(app) as c:
            return (await c.post("/v1/completions", json=completion(prompts, max_tokens=4))).json()
    body = run(go())
    assert [c["token_ids"] for c in body["choices"]] == [hf_greedy(tiny, p, 4) for p in prompts]
    assert body["usage"]["prompt_tokens"] == 32 and body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == 40
