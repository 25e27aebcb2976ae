"""The serving engine: requests -> sequences over paged KV blocks, continuous batching with chunked prefill,
prefix reuse from resident blocks and from the kvflow pool (docs/ENGINE.md)."""

from kvflow.engine.config import EngineConfig
from kvflow.engine.engine import Completion, LLMEngine, RequestError, RequestOutput
from kvflow.engine.sampling import SamplingError, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "Completion", "RequestOutput", "RequestError", "SamplingParams",
           "SamplingError"]
