"""A client nobody here wrote: vLLM's own benchmark client (``vllm bench serve``, from ``.venv-vllm``) against
``kvflow serve`` on the real model (smollm2-135m) with the checkpoint's tokenizer, as an operator would run it:
``--backend openai`` (/v1/completions) and ``openai-chat`` (/v1/chat/completions), datasets ``random`` and
``prefix_repetition``, ``--ignore-eos``. Every request succeeds and every answer is exactly the tokens asked for
(read from the client's own ``--save-result`` JSON); with ``random`` on completions the prompts are the lengths asked
for too (the client aligns them through the server's /tokenize).

The server is served under ``--served-model-name`` (the name the client sends) from a config with a fixed KV budget
and activation reserve and no pool, so it starts in seconds. The vLLM wheel's ``vllm`` console script fails on a
distribution lookup, so the client runs as ``vllm.benchmarks.serve.add_cli_args`` + ``main``, the four runs in one
client process (vLLM's import is most of its cost). A few prompts each: about a minute on a quiet 2-vCPU machine. ``make test`` runs it (``KVFLOW_TEST_VLLM=1``); without ``.venv-vllm`` or
that variable it skips and says why.
"""

import json
import os
import subprocess

import pytest

from kvflow.errors import ModelError
from kvflow.integrations.vllm_server import vllm_venv
from kvflow.net import free_port
from tests.server.helpers import kvflow_serve

VENV = vllm_venv()
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(VENV is None, reason="vLLM venv missing: run `make vllm`"),
              pytest.mark.skipif(os.environ.get("KVFLOW_TEST_VLLM") != "1",
                                 reason="runs vLLM's benchmark client (about a minute): opt in with KVFLOW_TEST_VLLM=1"),
              pytest.mark.timeout(900)]

NAME = "kvflow-smollm2"      # --served-model-name: what the client sends
PROMPTS, INPUT, OUTPUT = 6, 96, 12
CONFIG = "engine: {kv_budget: 512M, activation_reserve: 64M}\n"      # no pool:, no start-up probes
CASES = [(backend, dataset) for backend in ("openai", "openai-chat") for dataset in ("random", "prefix_repetition")]
CLIENT = ("import json, sys\nfrom vllm.benchmarks.serve import add_cli_args, main\n"
          "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
          "for argv in json.loads(sys.argv[1]):\n"
          "    p = FlexibleArgumentParser()\n    add_cli_args(p)\n    main(p.parse_args(argv))\n")


@pytest.fixture(scope="module")
def checkpoint():
    from kvflow.model import catalog
    try:
        return catalog.resolve("smollm2-135m")
    except ModelError as err:
        pytest.skip(f"smollm2-135m unavailable: {err}")


@pytest.fixture(scope="module")
def results(checkpoint, tmp_path_factory) -> dict:
    """Each case's ``--save-result`` JSON, from one client process against one server."""
    folder = tmp_path_factory.mktemp("bench-client")
    (folder / "serve.yaml").write_text(CONFIG)
    port = free_port()
    with kvflow_serve(folder / "serve.yaml", port, folder / "serve.log", "--served-model-name", NAME,
                      model="smollm2-135m").start(timeout_s=300):
        runs = [args(f"http://127.0.0.1:{port}", checkpoint, folder, backend, dataset) for backend, dataset in CASES]
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "OPENAI_API_KEY") and not k.startswith("VIRTUAL_ENV")}
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        r = subprocess.run([str(VENV / "bin" / "python"), "-c", CLIENT, json.dumps(runs)], cwd=folder, env=env,
                           capture_output=True, text=True, timeout=720)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {case: json.loads((folder / f"{case[0]}-{case[1]}.json").read_text()) for case in CASES}


def args(server: str, checkpoint, out, backend: str, dataset: str) -> list[str]:
    endpoint = "/v1/chat/completions" if backend == "openai-chat" else "/v1/completions"
    return ["--backend", backend, "--base-url", server, "--endpoint", endpoint, "--model", NAME,
            "--tokenizer", str(checkpoint), "--dataset-name", dataset, "--num-prompts", str(PROMPTS),
            "--random-input-len", str(INPUT), "--output-len", str(OUTPUT), "--ignore-eos", "--seed", "0",
            "--prefix-repetition-prefix-len", str(INPUT), "--prefix-repetition-suffix-len", str(INPUT // 2),
            "--prefix-repetition-num-prefixes", "2", "--save-result", "--result-dir", str(out),
            "--result-filename", f"{backend}-{dataset}.json"]


@pytest.mark.parametrize("backend,dataset", CASES)
def test_vllms_benchmark_client_gets_every_request_answered_with_the_tokens_it_asked_for(results, backend, dataset):
    got = results[backend, dataset]
    assert (got["completed"], got["failed"]) == (PROMPTS, 0), got.get("errors")
    assert got["total_output_tokens"] == PROMPTS * OUTPUT
    assert got["model_id"] == NAME and got["mean_ttft_ms"] > 0
    if (backend, dataset) == ("openai", "random"):
        assert got["total_input_tokens"] == PROMPTS * INPUT
