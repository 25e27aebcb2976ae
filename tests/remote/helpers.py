import torch

from kvflow.chunks.keys import chunk_keys

FP = "ab" * 16
GROUPS = [(0, 2), (2, 4)]


def remote_cfg(rp, *local, chunk_tokens: int = 16, **options) -> dict:
    """A pool config: the ``local`` device dicts, then the store of ``rp`` (probed with 4 MiB)."""
    dev = {"type": "remote", "url": rp.url, "cluster": rp.cluster}
    dev.update(options.pop("remote", {}))
    return {"devices": [*local, dev], "chunk_tokens": chunk_tokens, "probe_bytes": "4M", **options}


def context(chunks: int, seed: int = 0, chunk_tokens: int = 16):
    """(token ids, keys[chunk][group], {key: tensor}) of a synthetic context."""
    ids = torch.randint(0, 1000, (chunk_tokens * chunks,), generator=torch.Generator().manual_seed(seed))
    keys = chunk_keys(ids, FP, chunk_tokens, GROUPS)
    gen = torch.Generator().manual_seed(seed + 1)
    data = {k: torch.randn(2, 2, chunk_tokens, 8, generator=gen) for row in keys for k in row}
    return ids, keys, data


def remote_slot(pool) -> int:
    return next(i for i, s in enumerate(pool.slots) if s.cfg.type == "remote")
