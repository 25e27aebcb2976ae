"""`kvflow serve`: the OpenAI-compatible server over the kvflow engine."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Optional

import typer

from kvflow.cli.main import app
from kvflow.errors import KVFlowError


def _check_listen(host: str, port: int) -> None:
    if not 0 < port < 65536:
        raise KVFlowError(f"--port must be in 1..65535, got {port}")
    try:
        with socket.create_server((host, port)):
            pass
    except OSError as err:
        raise KVFlowError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None


@app.command()
def serve(model: str = typer.Option("tiny", "--model", help="preset name or local transformers checkpoint directory"),
          config: Optional[Path] = typer.Option(None, "--config", help="YAML/TOML with engine: and pool: sections"),
          host: str = typer.Option("127.0.0.1", "--host"),
          port: int = typer.Option(8000, "--port"),
          api_key: Optional[str] = typer.Option(None, "--api-key", envvar="KVFLOW_API_KEY",
                                                help="require 'Authorization: Bearer KEY' on every route but /health"),
          seed: int = typer.Option(0, "--seed", help="weights seed of a random-weight preset"),
          log_level: str = typer.Option("info", "--log-level")) -> None:
    """Serve MODEL with /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics."""
    import logging

    from kvflow.server import serve as run

    if config is not None and not config.is_file():
        raise KVFlowError(f"config file {config} not found")
    _check_listen(host, port)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run(model, str(config) if config else None, host=host, port=port, api_key=api_key, seed=seed,
        log_level=log_level)
