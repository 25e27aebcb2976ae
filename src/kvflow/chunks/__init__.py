"""KV chunks: prefix-chained keys and the self-describing record format. Knows nothing about devices."""

from kvflow.chunks.keys import ChunkKey, chunk_keys, layer_groups, prefix_hashes, record_key, tail_keys
from kvflow.chunks.record import (HEADER_SIZE, RecordHeader, decode, encode, encode_into, parse_header,
                                  record_size)

__all__ = ["ChunkKey", "chunk_keys", "layer_groups", "prefix_hashes", "record_key", "tail_keys", "HEADER_SIZE",
           "RecordHeader", "decode", "encode", "encode_into", "parse_header", "record_size"]
