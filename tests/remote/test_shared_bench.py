"""`kvflow bench shared`: bad options are one line; the aggregate section reports the ratio to the sum of the devices
alone and leaves none of its keys in the store."""

import subprocess
import sys

import pytest

from kvflow.bench.shared_bench import aggregate


def test_bad_options_are_one_line_and_exit_2():
    for args, words in [(["--caps", "1,2"], "--caps"), (["--only", "nope"], "--only"), (["--tokens", "12"], "--tokens")]:
        done = subprocess.run([sys.executable, "-m", "kvflow", "bench", "shared", *args], capture_output=True,
                              text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1 and words in lines[0], done.stderr


def test_the_aggregate_section_stripes_over_memory_disk_and_cluster_and_cleans_up(cluster, tmp_path):
    out = aggregate(cluster.url, True, str(tmp_path), 8 << 20, 256 << 10, [60e6, 40e6, 40e6], 4 << 20, 1,
                    lambda s: None)
    assert len(out["alone_bw"]) == 3 and all(b > 0 for b in out["alone_bw"])
    assert out["ratio_to_sum"] == pytest.approx(out["read_bw"] / sum(out["alone_bw"]))   # striped over the sum alone
    assert abs(sum(out["share"]) - 1) < 1e-9 and out["share"][2] > 0
    assert cluster.keys() == 0
