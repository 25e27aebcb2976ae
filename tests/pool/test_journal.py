"""The write-ahead log and checkpoint: recovery yields exactly the table of the longest valid prefix of the log,
whatever byte the log was cut at; a checkpoint is atomic; only one writer at a time."""

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.errors import KVFlowError
from kvflow.pool.journal import DEL, ENTRY_SIZE, PUT, Journal, Op, apply

digests = st.sampled_from([bytes([i]) * 16 for i in range(6)])
op_lists = st.lists(st.builds(lambda put, d, seq: Op(PUT if put else DEL, 0, d, seq * 4096, 100, seq, seq),
                              st.booleans(), digests, st.integers(0, 40)), max_size=40)


def replayed(ops):
    rows = {}
    for op in ops:
        apply(rows, op)
    return rows


def fresh(tmp_path):
    j = Journal(tmp_path / "idx")
    j.recover()
    j.write_checkpoint([], 0, j.gen)
    j.start()
    return j


@settings(max_examples=100, deadline=None)
@given(ops=op_lists, cut=st.floats(0, 1))
def test_recovery_is_the_valid_prefix_of_a_log_cut_at_any_byte(tmp_path_factory, ops, cut):
    root = tmp_path_factory.mktemp("j")
    j = fresh(root)
    j.append(ops)
    wal = j._wal_path(j.gen)
    j.close()
    size = int(os.path.getsize(wal) * cut)
    os.truncate(wal, size)
    rec = Journal(root / "idx").recover()
    assert rec.rows == replayed(ops[:size // ENTRY_SIZE])
    assert rec.torn == (size % ENTRY_SIZE != 0)


def test_a_flipped_byte_skips_only_its_entry(tmp_path):
    j = fresh(tmp_path)
    ops = [Op(PUT, 0, bytes([i]) * 16, i * 4096, 100, i, 7) for i in range(5)]
    j.append(ops)
    wal = j._wal_path(j.gen)
    j.close()
    data = bytearray(wal.read_bytes())
    data[2 * ENTRY_SIZE + 20] ^= 0xFF
    wal.write_bytes(bytes(data))
    rec = Journal(tmp_path / "idx").recover()
    assert set(rec.rows) == {op.digest for op in ops} - {ops[2].digest}
    assert rec.skipped == 1 and rec.damaged and not rec.torn      # recovery then scans the devices for ops[2]


def test_checkpoint_then_log_recovers_both(tmp_path):
    j = fresh(tmp_path)
    j.append([Op(PUT, 0, b"a" * 16, 0, 100, 1, 1)])
    gen = j.rotate()
    j.write_checkpoint([Op(PUT, 0, b"a" * 16, 0, 100, 1, 1)], 2, gen)
    j.append([Op(PUT, 0, b"b" * 16, 4096, 100, 2, 1), Op(DEL, 0, b"a" * 16, 0, 100, 1, 1)])
    j.close()
    rec = Journal(tmp_path / "idx").recover()
    assert set(rec.rows) == {b"b" * 16} and rec.next_seq == 3 and rec.checkpoint_ok
    assert sorted(p.name for p in (tmp_path / "idx").glob("wal.*")) == [f"wal.{gen:08d}"], "old logs deleted"


def test_a_corrupt_checkpoint_falls_back_to_the_log_alone(tmp_path):
    j = fresh(tmp_path)
    j.append([Op(PUT, 0, b"a" * 16, 0, 100, 1, 1)])
    j.close()
    ckpt = tmp_path / "idx" / "checkpoint"
    ckpt.write_bytes(ckpt.read_bytes()[:-1] + b"\0")
    rec = Journal(tmp_path / "idx").recover()
    assert not rec.checkpoint_ok and set(rec.rows) == {b"a" * 16}


def test_a_delete_only_removes_the_record_of_its_sequence_number():
    rows = replayed([Op(PUT, 0, b"a" * 16, 0, 100, 1, 1), Op(PUT, 0, b"a" * 16, 4096, 100, 2, 1),
                     Op(DEL, 0, b"a" * 16, 0, 100, 1, 1)])
    assert rows[b"a" * 16].seq == 2


def test_only_one_writer_may_open_an_index(tmp_path):
    j = Journal(tmp_path / "idx")
    with pytest.raises(KVFlowError, match="another process"):
        Journal(tmp_path / "idx")
    j.close()
    Journal(tmp_path / "idx").close()
