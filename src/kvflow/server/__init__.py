"""The OpenAI-compatible server over the kvflow engine (``kvflow serve``; docs/ENGINE.md)."""

from kvflow.server.app import build_app
from kvflow.server.build import build_engine, serve

__all__ = ["build_app", "build_engine", "serve"]
