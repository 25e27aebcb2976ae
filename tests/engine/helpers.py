import copy

import torch

from kvflow.cost import CostModel


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


_REFERENCE: dict = {}


def hf_greedy(runner, prompt: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """transformers' own greedy decoding: the ground truth for every engine output (memoised per model). With
    ``ignore_eos`` it does what a request with ``ignore_eos`` does: an eos token is a token like any other."""
    key = (runner.fingerprint, tuple(prompt), max_tokens, ignore_eos)
    if key not in _REFERENCE:
        config = copy.deepcopy(runner.hf_model.generation_config)
        if ignore_eos:
            config.eos_token_id = None
        out = runner.hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                                       generation_config=config)
        _REFERENCE[key] = out[0, len(prompt):].tolist()
    return list(_REFERENCE[key])


def synthetic_cost(runner, b=2e-8) -> CostModel:
    """A fixed cost model (no profiling in tests): plans depend on it, exactness must not."""
    return CostModel(runner.name, runner.fingerprint, 2, a=2e-6, b=b, d=3e-4, e=2e-4, head=1e-4,
                     kv_bytes_per_token_layer=runner.kv_bytes_per_token() // runner.num_layers,
                     num_layers=runner.num_layers)


BROKEN_SEED = 13


def break_sampling_of_seed(monkeypatch, message: str = "this request's sampler broke") -> int:
    """From now on the engine's sampler raises for requests seeded ``BROKEN_SEED`` (a failure that belongs to one
    request, inside a step) and samples as usual for every other; returns the seed."""
    import kvflow.engine.engine as engine_mod
    real = engine_mod.sample

    def flaky(logits, params, generator):
        if params.seed == BROKEN_SEED:
            raise RuntimeError(message)
        return real(logits, params, generator)
    monkeypatch.setattr(engine_mod, "sample", flaky)
    return BROKEN_SEED


def record_gathers(monkeypatch) -> list:
    """Every copy of K/V out of the paged cache from now on (a segment's gather or a group's), as a list the caller
    reads: empty when everything was attended in place."""
    from kvflow.engine.paged_cache import PagedKVCache
    gathered = []
    gather, gather_padded = PagedKVCache.gather, PagedKVCache.gather_padded
    monkeypatch.setattr(PagedKVCache, "gather", lambda self, layer, blocks, end, first=None:
                        gathered.append(("segment", end)) or gather(self, layer, blocks, end, first))
    monkeypatch.setattr(PagedKVCache, "gather_padded", lambda self, *a: gathered.append(("group",)) or
                        gather_padded(self, *a))
    return gathered
