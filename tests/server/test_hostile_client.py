"""`kvflow serve` under a hostile client (a real server process on loopback, with an API key): every bad
request is a 4xx with a JSON error — never a 5xx — the server answers a valid request afterwards, its RSS stays
bounded, and clients that go away or crowd in beside the bad ones leave no sequence, block, handle or thread behind.
The cases are tests/server/hostile.py's."""

import asyncio
import os
import socket
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvflow.net import free_port
from kvflow.stats import rss_bytes
from tests.server.helpers import kvflow_serve
from tests.server.hostile import AUTH, KEY, chat, completion, fixed, mutants

MUTANTS = int(os.environ.get("KVFLOW_HOSTILE_MUTANTS", "300"))
RSS_GROWTH_BOUND = 96 << 20      # over the whole corpus, after a warm-up that saw every code path once


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("hostile")
    cfg = home / "serve.yaml"
    cfg.write_text("engine:\n  kv_budget: 64M\n  block_size: 16\n")
    port, log = free_port(), home / "server.log"
    with kvflow_serve(cfg, port, log, "--api-key", KEY).start(timeout_s=90) as proc:
        yield f"http://127.0.0.1:{port}", proc
        assert "Traceback" not in log.read_text(errors="replace")     # before the stop: only what serving wrote


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", headers=AUTH, timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def send(c: httpx.Client, case) -> httpx.Response:
    if case.raw:
        return send_raw(str(c.base_url), case)
    return c.request(case.method, case.path, content=case.body, headers={"content-type": "application/json",
                                                                         **case.headers})


def send_raw(base: str, case) -> httpx.Response:
    """One HTTP/1.1 request written byte for byte on a socket (what an unusual client puts on the wire)."""
    url = httpx.URL(base)
    body = case.body or b""
    head = [f"{case.method} {case.path} HTTP/1.1", f"Host: {url.host}", "Connection: close",
            "Content-Type: application/json", f"Content-Length: {len(body)}",
            *[f"{k}: {v}" for k, v in case.headers.items()]]
    with socket.create_connection((url.host, url.port), timeout=60) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    status_line, _, rest = data.partition(b"\r\n")
    _, _, payload = rest.partition(b"\r\n\r\n")
    return httpx.Response(int(status_line.split()[1]), content=payload)


def check(case, r: httpx.Response) -> None:
    assert r.status_code < 500, (case.name, r.status_code, r.text[:300])
    if case.expect == "any":
        assert r.status_code == 200 or 400 <= r.status_code < 500, (case.name, r.status_code)
    else:
        assert r.status_code == case.expect, (case.name, r.status_code, r.text[:300])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and err["type"], (case.name, r.text[:300])


def test_every_hostile_request_is_a_4xx_json_error_or_served_and_the_server_keeps_serving(server):
    base, proc = server
    cases = fixed() + mutants(MUTANTS)
    valid = completion(prompt="still alive", max_tokens=4)
    with httpx.Client(base_url=base, timeout=120) as c:
        for case in cases[:20] + [cases[-1]]:                # warm-up: every path once before RSS is measured
            send(c, case)
        before = rss_bytes(proc.pid)
        for case in cases:
            check(case, send(c, case))
        r = c.post("/v1/completions", json=valid, headers=AUTH)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        after = rss_bytes(proc.pid)
    m = metrics(base)
    assert m["kvflow_engine_step_errors_total"] == 0 and m["kvflow_requests_failed_total"] == 0
    assert after - before < RSS_GROWTH_BOUND, (before >> 20, after >> 20)
    assert len(cases) >= 300


async def _burst(base: str, n: int) -> None:
    """n concurrent valid clients beside bad ones, a client that leaves mid-stream and one that leaves a
    non-streaming request; every valid one is answered 200."""
    async with httpx.AsyncClient(base_url=base, timeout=120, headers=AUTH) as c:
        async def valid(i):
            body = chat(max_tokens=8) if i % 2 else completion(prompt=f"user {i} asks", max_tokens=8)
            path = "/v1/chat/completions" if i % 2 else "/v1/completions"
            r = await c.post(path, json=body)
            assert r.status_code == 200, r.text

        async def bad(i):
            r = await c.post("/v1/completions", json=completion(max_tokens=str(i)))
            assert r.status_code == 400

        async def leaves_mid_stream():
            async with c.stream("POST", "/v1/completions",
                                json=completion(max_tokens=20_000, ignore_eos=True, stream=True)) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        break                       # leaving the block closes the connection

        async def leaves_while_waiting():
            with pytest.raises(httpx.TimeoutException):
                await c.post("/v1/completions", json=completion(max_tokens=20_000, ignore_eos=True), timeout=1.0)

        await asyncio.gather(*[valid(i) for i in range(n)], *[bad(i) for i in range(n // 4)], leaves_mid_stream(),
                             leaves_while_waiting())


def _settled(base: str, timeout: float = 30.0) -> dict[str, float]:
    """Metrics once nothing is in flight (the aborted requests have left the engine)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        idle = (m["kvflow_inflight_requests"] == 0 and m["kvflow_running_sequences"] == 0
                and m["kvflow_waiting_sequences"] == 0 and m["kvflow_queue_length"] == 0)
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def test_clients_that_leave_and_64_concurrent_ones_leave_no_sequence_block_or_thread_behind(server):
    base, _ = server
    asyncio.run(_burst(base, 64))
    first = _settled(base)
    asyncio.run(_burst(base, 64))
    second = _settled(base)
    for m in (first, second):
        assert m["kvflow_inflight_requests"] == 0 and m["kvflow_running_sequences"] == 0
        assert m["kvflow_waiting_sequences"] == 0 and m["kvflow_queue_length"] == 0
        assert m["kvflow_kv_block_usage_ratio"] == 0.0
    assert second["kvflow_process_threads"] == first["kvflow_process_threads"]
    assert second["kvflow_requests_aborted_total"] - first["kvflow_requests_aborted_total"] >= 2
    assert second["kvflow_engine_step_errors_total"] == 0
    generated = second["kvflow_generation_tokens_total"] - first["kvflow_generation_tokens_total"]
    assert generated < 2 * 20_000      # the two abandoned 20,000-token requests did not run to their end
