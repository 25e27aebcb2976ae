"""The record format: round trips in every storage dtype; any corruption or mismatch is detected."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.chunks import HEADER_SIZE, chunk_keys, decode, encode, parse_header
from kvflow.errors import RecordError

FP = "0123456789abcdef" * 2
KEYS = chunk_keys(torch.arange(64), FP, 16, [(0, 2), (2, 4)])
TENSOR = torch.randn(2, 2, 2, 16, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_in_every_storage_dtype(dtype):
    key = KEYS[2][1]
    buf = encode(key, TENSOR, seq=41, dtype=dtype)
    header, out = decode(buf, key)
    assert header.seq == 41 and header.dtype == dtype and header.tokens == (32, 48) and header.layers == (2, 4)
    assert out.dtype == dtype and out.shape == TENSOR.shape
    assert torch.equal(out, TENSOR.to(dtype))
    assert len(buf) == HEADER_SIZE + TENSOR.numel() * dtype.itemsize


_RECORD = bytes(encode(KEYS[1][0], TENSOR, seq=7, dtype=torch.float16))


@settings(max_examples=300, deadline=None)
@given(pos=st.integers(0, len(_RECORD) - 1), bit=st.integers(0, 7))
def test_any_single_flipped_bit_is_detected(pos, bit):
    buf = bytearray(_RECORD)
    buf[pos] ^= 1 << bit
    with pytest.raises(RecordError):
        decode(buf, KEYS[1][0])


def test_every_flipped_header_byte_is_detected():
    for pos in range(HEADER_SIZE):
        buf = bytearray(_RECORD)
        buf[pos] ^= 0xFF
        with pytest.raises(RecordError):
            decode(buf, KEYS[1][0])


def test_record_of_another_key_or_model_is_rejected():
    with pytest.raises(RecordError, match="key"):
        decode(_RECORD, KEYS[2][0])
    other_model = chunk_keys(torch.arange(64), "e" * 32, 16, [(0, 2)])[1][0]
    forged = type(other_model)(KEYS[1][0].digest, other_model.fingerprint, (16, 32), (0, 2))
    with pytest.raises(RecordError, match="model"):
        decode(_RECORD, forged)
    wrong_range = type(other_model)(KEYS[1][0].digest, FP, (16, 32), (2, 4))
    with pytest.raises(RecordError, match="range"):
        decode(_RECORD, wrong_range)


@pytest.mark.parametrize("cut", [0, 10, HEADER_SIZE - 1, HEADER_SIZE, len(_RECORD) - 1])
def test_truncated_record_is_rejected(cut):
    with pytest.raises(RecordError):
        decode(_RECORD[:cut], KEYS[1][0])


def test_header_alone_parses_for_recovery_scans():
    header = parse_header(_RECORD[:HEADER_SIZE])
    assert header.digest == KEYS[1][0].digest and header.total_size == len(_RECORD)
