"""ServerLimits: the ``server:`` section of a kvflow config file (``KVFLOW_SERVER_<FIELD>`` overrides) — what one
HTTP request may carry. A request over a limit is answered 413 (body) or 400 (the rest), naming the limit, before
any of it reaches the engine.

    server: {max_body_bytes: 32M, max_json_depth: 32, max_messages: 1024, max_prompts: 64}
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.config import _parse_size, check, load_section


@dataclass(slots=True)
class ServerLimits:
    max_body_bytes: int = 32 * 2**20    # request body, bytes ("32M"); a 128K-token prompt is < 1 MB of JSON
    max_json_depth: int = 32            # nesting of arrays / objects; the deepest valid request is 4 levels
    max_messages: int = 1024            # chat messages per request
    max_prompts: int = 64               # prompts per completion request (the engine's default max_num_seqs)

    def validate(self) -> None:
        if isinstance(self.max_body_bytes, str):
            self.max_body_bytes = _parse_size(self.max_body_bytes)
        check(self.max_body_bytes >= 1024, f"server.max_body_bytes must be >= 1K, got {self.max_body_bytes}")
        check(4 <= self.max_json_depth <= 512, f"server.max_json_depth must be in [4, 512], got {self.max_json_depth}")
        check(self.max_messages >= 1, f"server.max_messages must be >= 1, got {self.max_messages}")
        check(self.max_prompts >= 1, f"server.max_prompts must be >= 1, got {self.max_prompts}")

    @classmethod
    def load(cls, data: dict | None = None, env=None) -> ServerLimits:
        return load_section(cls, "server", data, env)
