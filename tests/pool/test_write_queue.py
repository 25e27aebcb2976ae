"""The pool's background write queue (engine tier and vLLM connector): a full queue drops and counts, never blocks;
a failed write is counted, never raised; close writes what was queued."""

import threading
from collections import Counter

from kvflow.pool.write_queue import WriteQueue


def test_a_full_queue_drops_and_counts_and_close_writes_what_was_queued():
    gate, written = threading.Event(), []

    def write(items):
        gate.wait()
        written.append(items)
        return len(items)

    counters = Counter()
    q = WriteQueue(write, size=1, counters=counters)
    offered = [q.offer({i: 0, -i - 1: 0}) for i in range(5)]     # the writer holds one, the queue one more
    assert offered[:1] == [True] and not all(offered)
    assert counters["writes_queued"] + counters["writes_dropped"] == 5
    assert counters["records_dropped"] == 2 * counters["writes_dropped"]
    gate.set()
    q.close()
    assert counters["records_written"] == 2 * counters["writes_queued"] == 2 * len(written)
    assert not q.offer({9: 0}) and counters["writes_dropped"] == 5 - len(written) + 1     # closed: dropped too


def test_a_failed_write_is_counted_not_raised():
    counters = Counter()
    q = WriteQueue(lambda items: 1 / 0, size=4, counters=counters)
    q.offer({1: 0})
    q.flush()
    q.close()
    assert counters["write_errors"] == 1 and counters["records_written"] == 0
