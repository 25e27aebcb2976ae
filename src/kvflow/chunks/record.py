"""The one on-disk / in-memory record format. Self-describing: a record alone says what it is and whether
it is intact, so recovery and corruption checks need no other file (Mooncake's model).

Layout (little-endian), header is always HEADER_SIZE bytes, payload follows::

    0   magic      4s   b"KVFR"
    4   version    u16
    6   kind       u8    0 = kv, 1 = act (boundary activations)
    7   dtype      u8    storage dtype code
    8   key        16s   ChunkKey.digest
    24  model      16s   model fingerprint
    40  tok_lo     u64   token range [tok_lo, tok_hi)
    48  tok_hi     u64
    56  layer_lo   u16   layer range [layer_lo, layer_hi)
    58  layer_hi   u16
    60  ndim       u16
    62  (pad)      u16
    64  shape      6 x u32  (unused dims 0)
    88  seq        u64   pool-wide sequence number (newest wins on recovery)
    96  length     u64   payload bytes
    104 checksum   u64   xxh3-64 of payload
    112 (reserved) 8x
    120 hcheck     u64   xxh3-64 of header bytes [0, 120)
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch
import xxhash

from kvflow.chunks.keys import KINDS, ChunkKey
from kvflow.errors import RecordError

MAGIC = b"KVFR"
VERSION = 1
HEADER_SIZE = 128
_FMT = struct.Struct("<4sHBB16s16sQQHHHH6IQQQ8x")
_HCHECK = struct.Struct("<Q")
assert _FMT.size == 120 and _FMT.size + _HCHECK.size == HEADER_SIZE

DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
CODE_DTYPES = {v: k for k, v in DTYPE_CODES.items()}
KIND_NAMES = {v: k for k, v in KINDS.items()}


@dataclass(frozen=True, slots=True)
class RecordHeader:
    kind: str
    dtype: torch.dtype
    digest: bytes
    fingerprint: str
    tokens: tuple[int, int]
    layers: tuple[int, int]
    shape: tuple[int, ...]
    seq: int
    length: int
    checksum: int

    @property
    def total_size(self) -> int:
        return HEADER_SIZE + self.length


def kv_record_dtype(asked: torch.dtype, model: torch.dtype) -> torch.dtype:
    """The dtype a model's KV records are stored in: the one asked for (a pool's ``storage_dtype``), never wider
    than the model computes in — a bf16 model's K/V widened to fp32 doubles every record and adds no information."""
    return model if model.itemsize < asked.itemsize else asked


def record_size(shape, dtype: torch.dtype) -> int:
    n = 1
    for s in shape:
        n *= s
    return HEADER_SIZE + n * dtype.itemsize


def encode_into(buf, key: ChunkKey, tensor: torch.Tensor, seq: int, dtype: torch.dtype = torch.float32) -> int:
    """Write one record into ``buf`` (a writable buffer of at least record_size bytes). Returns its size.
    Hot path: one cast/copy of the payload straight into ``buf``, one checksum pass."""
    if dtype not in DTYPE_CODES:
        raise RecordError(f"unsupported storage dtype {dtype}")
    if tensor.dim() > 6:
        raise RecordError(f"tensor of {tensor.dim()} dims: records hold at most 6")
    view = memoryview(buf).cast("B")
    length = tensor.numel() * dtype.itemsize
    payload = view[HEADER_SIZE:HEADER_SIZE + length]
    if len(payload) != length:
        raise RecordError(f"buffer of {len(view)} bytes too small for a {HEADER_SIZE + length}-byte record")
    out = torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(tensor.shape) if length else None
    if out is not None:
        out.copy_(tensor)
    shape = tuple(tensor.shape) + (0,) * (6 - tensor.dim())
    head = _FMT.pack(MAGIC, VERSION, KINDS[key.kind], DTYPE_CODES[dtype], key.digest, bytes.fromhex(key.fingerprint),
                     key.tokens[0], key.tokens[1], key.layers[0], key.layers[1], tensor.dim(), 0, *shape, seq, length,
                     xxhash.xxh3_64_intdigest(payload))
    view[:_FMT.size] = head
    view[_FMT.size:HEADER_SIZE] = _HCHECK.pack(xxhash.xxh3_64_intdigest(head))
    return HEADER_SIZE + length


def encode(key: ChunkKey, tensor: torch.Tensor, seq: int, dtype: torch.dtype = torch.float32) -> bytearray:
    buf = bytearray(record_size(tensor.shape, dtype))
    encode_into(buf, key, tensor, seq, dtype)
    return buf


def parse_header(buf) -> RecordHeader:
    """Parse and verify a header (magic, version, header checksum). Raises RecordError."""
    view = memoryview(buf).cast("B")
    if len(view) < HEADER_SIZE:
        raise RecordError(f"truncated record: {len(view)} bytes, header needs {HEADER_SIZE}")
    head = view[:_FMT.size]
    (magic, version, kind, dcode, digest, model, t0, t1, l0, l1, ndim, _pad, *rest) = _FMT.unpack(head)
    shape, (seq, length, checksum) = rest[:6], rest[6:]
    if magic != MAGIC:
        raise RecordError("not a kvflow record (bad magic)")
    if _HCHECK.unpack(view[_FMT.size:HEADER_SIZE])[0] != xxhash.xxh3_64_intdigest(head):
        raise RecordError("record header checksum mismatch")
    if version != VERSION:
        raise RecordError(f"record version {version}, this kvflow reads {VERSION}")
    if kind not in KIND_NAMES or dcode not in CODE_DTYPES or ndim > 6:
        raise RecordError("record header has an unknown kind, dtype or rank")
    dims = tuple(shape[:ndim])
    dtype = CODE_DTYPES[dcode]
    n = 1
    for d in dims:
        n *= d
    if n * dtype.itemsize != length:
        raise RecordError("record header shape and length disagree")
    return RecordHeader(KIND_NAMES[kind], dtype, digest, model.hex(), (t0, t1), (l0, l1), dims, seq, length, checksum)


def decode(buf, expect: ChunkKey | None = None, *, verify: bool = True) -> tuple[RecordHeader, torch.Tensor]:
    """Verify and view one record. Returns (header, payload tensor in storage dtype, sharing ``buf``).
    ``expect`` pins key, model, token range, layer range and kind. Raises RecordError on any mismatch."""
    header = parse_header(buf)
    view = memoryview(buf).cast("B")
    payload = view[HEADER_SIZE:HEADER_SIZE + header.length]
    if len(payload) != header.length:
        raise RecordError(f"truncated record: payload {len(payload)} of {header.length} bytes")
    if expect is not None:
        if header.digest != expect.digest:
            raise RecordError(f"record holds key {header.digest.hex()}, expected {expect.hex}")
        if header.fingerprint != expect.fingerprint:
            raise RecordError(f"record of model {header.fingerprint}, expected {expect.fingerprint}")
        if header.tokens != expect.tokens or header.layers != expect.layers or header.kind != expect.kind:
            raise RecordError("record token range, layer range or kind differs from its key")
    if verify and xxhash.xxh3_64_intdigest(payload) != header.checksum:
        raise RecordError("record payload checksum mismatch")
    tensor = torch.frombuffer(payload, dtype=torch.uint8).view(header.dtype).view(header.shape) if header.length \
        else torch.empty(header.shape, dtype=header.dtype)
    return header, tensor
