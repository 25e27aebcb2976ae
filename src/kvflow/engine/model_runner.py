"""BatchRunner: one engine step — every scheduled sequence's new tokens (prefill chunks and decodes) in ONE forward
pass of the model's own decoder layers over the paged KV.

The step's tokens are packed into one row [1, T_step, hidden] (no padding); each layer's attention sees the
gathered K/V of all the step's sequences [1, H, K_step, D] and an explicit block-diagonal causal mask:

    keys  ->   | seq A: 0..a+n_a |  seq B: 0..b+1  |
    A's rows   |  k <= q (causal)|   masked        |
    B's row    |    masked       |  k <= q         |

so token q of sequence s attends exactly to positions <= q of s, as in its own full prefill. Linear layers (most
of the FLOPs and all weight reads) run once for the whole step; that is where batched decode gains.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from kvflow.engine.paged_cache import PagedKVCache
from kvflow.model.runner import ModelRunner


@dataclass(slots=True)
class StepItem:
    """Compute positions [start, start + len(token_ids)) of one sequence; logits of the last one if ``sample``."""
    block_table: list[int]
    start: int
    token_ids: list[int]
    sample: bool


class _StepSlot:
    """Duck-typed transformers ``Cache`` for one step: ``update`` writes the step's new K/V into their slots and
    returns the gathered K/V every query of the step may attend to."""

    def __init__(self, cache: PagedKVCache, write: torch.Tensor, read: torch.Tensor):
        self.cache, self.write_slots, self.read_slots = cache, write, read

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.cache.write(layer_idx, self.write_slots, key_states, value_states)
        return self.cache.gather(layer_idx, self.read_slots)


class BatchRunner:
    def __init__(self, runner: ModelRunner, cache: PagedKVCache):
        self.runner, self.cache = runner, cache
        model = runner.hf_model
        self._base = model.model
        params = inspect.signature(runner.layers[0].forward).parameters
        self._cache_kw = next(k for k in ("cache", "past_key_values", "past_key_value") if k in params)
        self._windows = [runner._sliding_window(i) for i in range(runner.num_layers)]

    def execute(self, items: list[StepItem]) -> torch.Tensor:
        """Run the step; returns fp32 logits [n_sample, vocab] of the items with ``sample``, in order."""
        assert items
        cache = self.cache
        ids, qpos, qseg, kpos, kseg, write, read, last = [], [], [], [], [], [], [], []
        offset = 0
        for s, it in enumerate(items):
            n, end = len(it.token_ids), it.start + len(it.token_ids)
            ids.extend(it.token_ids)
            qpos.append(torch.arange(it.start, end))
            qseg.append(torch.full((n,), s))
            kpos.append(torch.arange(0, end))
            kseg.append(torch.full((end,), s))
            write.append(cache.slots(it.block_table, it.start, end))
            read.append(cache.slots(it.block_table, 0, end))
            offset += n
            if it.sample:
                last.append(offset - 1)
        qpos, qseg, kpos, kseg = (torch.cat(x) for x in (qpos, qseg, kpos, kseg))
        slot = _StepSlot(cache, torch.cat(write), torch.cat(read))
        allowed = (qseg[:, None] == kseg[None, :]) & (kpos[None, :] <= qpos[:, None])
        masks: dict[int | None, torch.Tensor] = {}
        with torch.inference_mode():
            hidden = self._base.embed_tokens(torch.tensor(ids, dtype=torch.long).view(1, -1))
            position_ids = qpos.view(1, -1)
            position_embeddings = self._base.rotary_emb(hidden, position_ids)
            for layer, module in enumerate(self.runner.layers):
                window = self._windows[layer]
                if window not in masks:
                    m = allowed if window is None else allowed & ((qpos[:, None] - kpos[None, :]) < window)
                    masks[window] = m.view(1, 1, *m.shape)
                hidden = module(hidden, attention_mask=masks[window], position_ids=position_ids,
                                position_embeddings=position_embeddings, use_cache=True, **{self._cache_kw: slot})
                if isinstance(hidden, tuple):
                    hidden = hidden[0]
            if not last:
                return torch.empty(0, self.runner.config.vocab_size)
            rows = hidden[0, last].unsqueeze(1)                                     # [k, 1, hidden]
            return self.runner.hf_model.lm_head(self._base.norm(rows)).view(len(last), -1).float()
