"""Chunk keys: prefix-chained hashes, so a key names a chunk *and everything before it*.

    h_0 = xxh3_128(fingerprint | chunk_tokens | tokens[0:c])
    h_i = xxh3_128(h_{i-1} | tokens[i*c:(i+1)*c])
    key(i, layers, kind) = xxh3_128(h_i | kind | layer range)

A context's partial tail (fewer than ``chunk_tokens`` tokens) gets no key of this chain: a prefix lookup and a
restoration work in full chunks, and a tail is recomputed together with the query. One exception, by its own key:
the engine stores a *preempted* sequence's tail (tail_keys), which that sequence asks for when it comes back with
the same tokens::

    t   = xxh3_128(h_k | "tail" | tokens[k*c:n])       (0 < n - k*c < c, k full chunks before it)

Its input is never as long as a full chunk's (16 + 4 + 8m bytes against 16 + 8c), so no tail hash equals a chunk hash
by construction of the input; the record holds exactly tokens [k*c, n).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import xxhash

KINDS = {"kv": 0, "act": 1}  # KV of a layer range / boundary activations (hidden state entering a layer)


@dataclass(frozen=True, slots=True)
class ChunkKey:
    """Identity of one stored record. ``digest`` is what the pool indexes; the rest is checked on read."""
    digest: bytes          # 16 bytes
    fingerprint: str       # model fingerprint (32 hex chars)
    tokens: tuple[int, int]
    layers: tuple[int, int]
    kind: str = "kv"

    def __post_init__(self):
        assert len(self.digest) == 16 and self.kind in KINDS and self.tokens[0] < self.tokens[1]
        assert 0 <= self.layers[0] <= self.layers[1]

    @property
    def hex(self) -> str:
        return self.digest.hex()


def _token_bytes(token_ids) -> bytes:
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.cpu().numpy()
    return np.ascontiguousarray(np.asarray(token_ids, dtype=np.int64)).tobytes()


def _seed(fingerprint: str, chunk_tokens: int) -> bytes:
    """h_{-1}: what the first chunk's hash chains on."""
    return xxhash.xxh3_128(f"kvflow|{fingerprint}|{chunk_tokens}".encode()).digest()


def prefix_hashes(token_ids, fingerprint: str, chunk_tokens: int) -> list[bytes]:
    """One 16-byte hash per *full* chunk of ``token_ids``, each covering the whole prefix up to its end."""
    assert chunk_tokens > 0
    raw = _token_bytes(token_ids)
    n_full = len(raw) // 8 // chunk_tokens
    step = chunk_tokens * 8
    prev = _seed(fingerprint, chunk_tokens)
    out = []
    for i in range(n_full):
        prev = xxhash.xxh3_128(prev + raw[i * step:(i + 1) * step]).digest()
        out.append(prev)
    return out


def tail_keys(token_ids, fingerprint: str, chunk_tokens: int, layer_groups: list[tuple[int, int]],
              kind: str = "kv") -> list[ChunkKey]:
    """Keys of the partial chunk at the end of ``token_ids`` (tokens [k*c, n) after its k full chunks), one per
    layer group; [] when ``token_ids`` ends on a chunk boundary. Names exactly this prefix: the same tokens and
    nothing more or less (module docstring)."""
    return _tail_row(token_ids, prefix_hashes(token_ids, fingerprint, chunk_tokens), fingerprint, chunk_tokens,
                     layer_groups, kind)


def _tail_row(token_ids, hashes: list[bytes], fingerprint: str, chunk_tokens: int,
              layer_groups: list[tuple[int, int]], kind: str) -> list[ChunkKey]:
    """tail_keys from the full chunks' ``hashes`` (prefix_hashes of the same ids), chained on the last of them."""
    raw = _token_bytes(token_ids)
    n, k = len(raw) // 8, len(hashes)
    if n == k * chunk_tokens:
        return []
    prev = hashes[-1] if hashes else _seed(fingerprint, chunk_tokens)
    h = xxhash.xxh3_128(prev + b"tail" + raw[k * chunk_tokens * 8:]).digest()
    return [ChunkKey(record_digest(h, layer_tail(g, kind)), fingerprint, (k * chunk_tokens, n), g, kind)
            for g in layer_groups]


def layer_tail(layers: tuple[int, int], kind: str = "kv") -> bytes:
    """What a record key adds to its chunk's prefix hash: kind and layer range."""
    return bytes([KINDS[kind]]) + layers[0].to_bytes(2, "little") + layers[1].to_bytes(2, "little")


def record_digest(prefix_hash: bytes, tail: bytes) -> bytes:
    """The pool's index key. Hot path for prefix lookups: takes a precomputed :func:`layer_tail`."""
    return xxhash.xxh3_128_digest(prefix_hash + tail)


def record_key(prefix_hash: bytes, fingerprint: str, index: int, chunk_tokens: int,
               layers: tuple[int, int], kind: str = "kv") -> ChunkKey:
    return ChunkKey(record_digest(prefix_hash, layer_tail(layers, kind)), fingerprint,
                    (index * chunk_tokens, (index + 1) * chunk_tokens), layers, kind)


def chunk_keys(token_ids, fingerprint: str, chunk_tokens: int, layer_groups: list[tuple[int, int]],
               kind: str = "kv", tail: bool = False) -> list[list[ChunkKey]]:
    """keys[i][g]: record of full chunk i, layer group g; with ``tail``, a last row of tail_keys where the ids end
    inside a chunk (one pass over the prefix hashes for both)."""
    hashes = prefix_hashes(token_ids, fingerprint, chunk_tokens)
    rows = [[record_key(h, fingerprint, i, chunk_tokens, g, kind) for g in layer_groups]
            for i, h in enumerate(hashes)]
    last = _tail_row(token_ids, hashes, fingerprint, chunk_tokens, layer_groups, kind) if tail else []
    return rows + [last] if last else rows


def layer_groups(num_layers: int, layers_per_record: int) -> list[tuple[int, int]]:
    """Split [0, num_layers) into consecutive groups of ``layers_per_record`` (the last may be shorter)."""
    assert layers_per_record > 0
    return [(l, min(l + layers_per_record, num_layers)) for l in range(0, num_layers, layers_per_record)]
