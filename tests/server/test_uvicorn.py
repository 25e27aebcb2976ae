"""A real uvicorn server on 127.0.0.1 driven by the official openai client: streaming and non-streaming agree
with generate, and shutdown drains the running request and flushes the pool's write queue; `kvflow serve` starts
and stops on SIGINT."""

import signal
import threading

import httpx
import openai
import uvicorn

from kvflow import KVPool, Restorer
from kvflow.net import free_port
from tests.engine.helpers import hf_greedy, ids, synthetic_cost
from tests.server.helpers import MODEL, kvflow_serve, make_app, wait_healthy


def test_openai_client_against_uvicorn_then_shutdown_flushes_pool_writes(tiny):
    restorer = Restorer(tiny, KVPool.memory("64M", chunk_tokens=16), cost=synthetic_cost(tiny))
    app, engine = make_app(tiny, restorer=restorer)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_healthy(port)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        prompt = ids(33, 1)
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
        assert plain.choices[0].model_extra["token_ids"] == hf_greedy(tiny, prompt, 5)
        streamed = "".join(c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=5, temperature=0, stream=True) if c.choices)
        assert streamed == plain.choices[0].text
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, temperature=0)
        assert chat.usage.completion_tokens == 4
        try:
            client.completions.create(model="other", prompt="x")
            raise AssertionError("unknown model accepted")
        except openai.NotFoundError:
            pass
    finally:
        server.should_exit = True
        thread.join(timeout=60)
    assert not thread.is_alive()
    assert engine.pool.counters["records_written"] >= 2 * tiny.num_layers    # 37 computed tokens: 2 chunks
    assert engine.pool.writes.pending() == 0


def test_kvflow_serve_starts_answers_and_stops_on_sigint(tmp_path):
    port = free_port()
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("engine:\n  kv_budget: 4M\n  block_size: 8\n")
    with kvflow_serve(cfg, port, tmp_path / "serve.log").start(timeout_s=90) as server:
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(timeout=60) == 0
