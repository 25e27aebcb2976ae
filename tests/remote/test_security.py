"""Security of the shared tier: an ACL user limited to kvflow's key prefix, TLS to every node (tls-cluster yes), the
password from the environment or a file and never shown; a wrong password, a TLS mismatch or an unreachable
cluster at the start of `kvflow serve` is one error line and exit 2."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import redis

from kvflow import KVPool, Restorer
from kvflow.errors import ConfigError
from kvflow.net import free_port
from kvflow.pool.config import PoolConfig
from kvflow.pool.redis_local import RedisProcs, redis_available
from tests.remote.helpers import remote_cfg
from tests.restore.test_restore_exactness import assert_exact, ids, synthetic_cost
from tests.server.helpers import kvflow_serve

ROOT = str(Path(__file__).resolve().parents[2])
SECRET = "Sekr1t-pw-7f3a"                       # the needle: must never appear in any output
C = 32
pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))]


@pytest.fixture(scope="module")
def secure():
    """A 3-master cluster serving TLS only to clients that trust its throwaway CA, with an ACL user ``kvflow``
    (password SECRET) allowed only keys under ``kvflow:``."""
    rp = RedisProcs(masters=3, cluster=True, tls=True, user="kvflow", password=SECRET).start()
    try:
        yield rp
    finally:
        rp.stop()


def secure_dev(rp, **over) -> dict:
    return {"type": "remote", "url": rp.url, "cluster": True, "username": "kvflow", "tls": {"ssl_ca_certs": rp.ca},
            **over}


def test_the_password_comes_from_the_device_the_environment_or_a_file_and_a_bad_file_is_one_line(tmp_path,
                                                                                               monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text(SECRET + "\n")
    dev = {"type": "remote", "url": "redis://127.0.0.1:1"}
    load = lambda **pool: PoolConfig.load({"chunk_tokens": 16, "devices": [{**dev, **pool.pop("dev", {})}], **pool})
    assert load(dev={"password_file": str(secret)}).devices[0].password == SECRET
    assert load(remote_password_file=str(secret)).devices[0].password == SECRET
    assert load(dev={"password": "own"}, remote_password_file=str(secret)).devices[0].password == "own"
    monkeypatch.setenv("KVFLOW_POOL_REMOTE_PASSWORD_FILE", str(secret))
    assert load().devices[0].password == SECRET
    monkeypatch.delenv("KVFLOW_POOL_REMOTE_PASSWORD_FILE")
    monkeypatch.setenv("KVFLOW_POOL_REMOTE_PASSWORD", SECRET)
    cfg = load()
    assert cfg.devices[0].password == SECRET and SECRET not in repr(cfg)
    monkeypatch.delenv("KVFLOW_POOL_REMOTE_PASSWORD")
    with pytest.raises(ConfigError, match=r"pool.remote_password_file: cannot read .*missing"):
        load(remote_password_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match=r"pool.devices\[0\].password_file: .* is empty"):
        load(dev={"password_file": str(tmp_path / "empty")})


def test_an_acl_user_over_tls_stores_and_restores_exactly_and_the_store_refuses_it_keys_outside_its_prefix(
        tiny, secure, tmp_path):
    (tmp_path / "pw").write_text(SECRET)
    cfg = remote_cfg(secure, chunk_tokens=C, remote=secure_dev(secure, password_file=str(tmp_path / "pw")))
    context, query = ids(6 * C + 5, 61), ids(7, 62)
    with KVPool.open(cfg) as first:
        Restorer(tiny, first, cost=synthetic_cost(tiny), calibrate=False).store(context)
    with KVPool.open(cfg) as pool:                # a second pool: only the store holds the context
        restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny), calibrate=False)
        assert restorer.lookup(context, query.numel())[0].stored_chunks == 6
        assert_exact(tiny, restorer.restore(context, query, "load"), context, query)
        assert pool.stats()["misses"] == 0 and pool.stats()["devices"][0]["tls"]
    assert secure.keys() > 0
    with redis.cluster.RedisCluster(host="127.0.0.1", port=secure.tls_ports[0], ssl=True, ssl_ca_certs=secure.ca,
                                    username="kvflow", password=SECRET) as user:
        with pytest.raises(redis.exceptions.NoPermissionError):
            user.set(b"other:key", b"x")
    with pytest.raises(redis.exceptions.ConnectionError):       # the plain port wants the admin, not this user
        redis.Redis(port=secure.ports[0], username="kvflow", password="guess").ping()


def _serve_fails(tmp_path, name: str, dev: dict, env: dict | None = None) -> str:
    """stderr of `kvflow serve` on a pool whose only device is ``dev``, asserted one line and exit 2."""
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(json.dumps({"engine": {"kv_budget": "4M", "block_size": 8},
                               "pool": {"chunk_tokens": C, "probe_bytes": "1M", "devices": [dev]}}))
    done = subprocess.run([sys.executable, "-m", "kvflow", "serve", "--model", "tiny", "--config", str(cfg),
                           "--port", str(free_port())], capture_output=True, text=True, timeout=240, cwd=ROOT,
                          env={**os.environ, "KVFLOW_TORCH_THREADS": "1", **(env or {})})
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (name, done.stderr[-2000:])
    assert SECRET not in done.stderr + done.stdout and "Traceback" not in done.stderr
    return lines[0]


def test_a_wrong_password_a_tls_mismatch_or_an_unreachable_cluster_stops_kvflow_serve_with_one_line(
        secure, tmp_path):
    wrong = _serve_fails(tmp_path, "wrong", secure_dev(secure), env={"KVFLOW_POOL_REMOTE_PASSWORD": SECRET + "x"})
    assert "refused the credentials of ACL user 'kvflow'" in wrong
    untrusted = _serve_fails(tmp_path, "ca", secure_dev(secure, tls=None), env={"KVFLOW_POOL_REMOTE_PASSWORD": SECRET})
    assert "TLS handshake failed" in untrusted and "CERTIFICATE_VERIFY_FAILED" in untrusted
    plain = secure_dev(secure, url=secure.url.replace("rediss://", "redis://"), tls=None, timeout_s=1)
    assert "does not answer at start" in _serve_fails(tmp_path, "plain", plain,
                                                      env={"KVFLOW_POOL_REMOTE_PASSWORD": SECRET})
    down = {"type": "remote", "url": f"redis://127.0.0.1:{free_port()},127.0.0.1:{free_port()}", "timeout_s": 0.5}
    assert "does not answer at start" in _serve_fails(tmp_path, "down", down)


def test_the_secret_never_appears_in_logs_stats_metrics_or_the_config(secure, tmp_path, caplog, monkeypatch):
    pool = {"chunk_tokens": C, "probe_bytes": "1M", "index_dir": str(tmp_path / "idx"),
            "devices": [{"type": "memory", "capacity": "16M"}, secure_dev(secure)], "remote_placement": "copy"}
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(json.dumps({"engine": {"kv_budget": "4M", "block_size": 8}, "pool": pool}))
    with caplog.at_level(logging.DEBUG):
        loaded = PoolConfig.load({**pool, "remote_password": SECRET})
        with KVPool.open(loaded) as p:
            seen = [repr(loaded), json.dumps(p.stats(), default=str), repr(p.slots)]
    seen.append(caplog.text)
    port = free_port()
    monkeypatch.setenv("KVFLOW_POOL_REMOTE_PASSWORD", SECRET)       # the serving processes' only source of it
    proc = kvflow_serve(cfg, port, tmp_path / "serve.log", "--log-level", "debug")
    try:
        proc.spawn().wait_ready(180)
        body = {"model": "tiny", "prompt": ids(4 * C + 3, 71).tolist(), "max_tokens": 4, "temperature": 0}
        httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).raise_for_status()
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
        seen.append(metrics)
        stat = subprocess.run([sys.executable, "-m", "kvflow", "pool", "stat", "--json", str(cfg)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert stat.returncode == 0, stat.stderr[-1000:]
        seen += [stat.stdout, stat.stderr]
    finally:
        proc.kill()
    seen.append((tmp_path / "serve.log").read_text())
    assert all(SECRET not in text for text in seen)
    assert "kvflow_pool" in metrics and '"tls": true' in stat.stdout       # really read, over TLS
