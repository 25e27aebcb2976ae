"""OpenAI request bodies (the fields kvflow honours; unknown fields are ignored as OpenAI's servers do) and the
mapping to SamplingParams. Extensions, as in vLLM: ``top_k``, ``stop_token_ids``, ``ignore_eos``; token-id prompts."""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

from kvflow.engine import SamplingParams


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def sampling(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(max_tokens=default_max if self.max_tokens is None else self.max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                              stop=stop, stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_Base):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    echo: bool = False
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[dict[str, Any]], None] = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatRequest(_Base):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
