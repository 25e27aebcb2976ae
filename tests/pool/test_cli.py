"""`kvflow pool init|stat|probe|fsck` and `kvflow bench pool`: tables on stdout, one error line + exit 2 on bad
input, fsck exits 1 after finding (and dropping) bad records."""

import json
import textwrap

import pytest

from kvflow.bench import pool_bench
from kvflow.cli.main import main
from kvflow.pool import KVPool

from .helpers import context_keys, tensor_for


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "kvflow.yaml"
    path.write_text(textwrap.dedent("""
        pool:
          index_dir: idx
          probe_bytes: 2M
          devices:
            - {type: extent, path: disk.img, capacity: 16M, bandwidth: 2G}
            - {type: files, path: files, capacity: 8M, bandwidth: 1G}
        """))
    monkeypatch.chdir(tmp_path)
    return path


def test_init_stat_probe_fsck(config, capsys):
    assert main(["pool", "init", str(config)]) == 0
    assert "extent:" in capsys.readouterr().out
    keys = context_keys(6)
    with KVPool.open(config) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
    assert main(["pool", "stat", "--json"]) == 0                      # ./kvflow.yaml by default
    st = json.loads(capsys.readouterr().out)
    assert st["records"] == 6 and st["readonly"] and len(st["devices"]) == 2
    assert main(["pool", "probe", str(config), "--size", "1M"]) == 0
    assert main(["pool", "fsck", str(config)]) == 0
    assert "checked 6 records" in capsys.readouterr().out


def test_fsck_reports_drops_and_exits_1_on_bad_records(config, capsys):
    keys = context_keys(4)
    with KVPool.open(config) as pool:
        pool.put_many({k: tensor_for(k) for k in keys})
        digest, _dev, off, *_ = next(e for e in pool.entries() if e[1] == 0)     # a record on the extent
    bad = next(k for k in keys if k.digest == digest)
    with open(config.parent / "disk.img", "r+b") as f:
        f.seek(4096 + off + 500)
        f.write(b"\xff\xfe")
    for argv in (["pool", "fsck", "--dry-run", str(config)], ["pool", "fsck", str(config)]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 1
    out = capsys.readouterr().out
    assert bad.hex in out and "1 bad dropped" in out
    assert main(["pool", "fsck", str(config)]) == 0


@pytest.mark.parametrize("argv, message", [
    (["pool", "stat", "missing.yaml"], "missing.yaml not found"),
    (["pool", "stat"], "not found"),
    (["bench", "pool", "--disk-dir", "/no/such/dir"], "is not a folder"),
    (["bench", "pool", "--only", "striping,bogus"], "--only: unknown section bogus"),
    (["bench", "pool", "--loop-caps", "1,0,2"], "--loop-caps: 1 to 8 positive numbers"),
    (["bench", "pool", "--loop-base", "0"], "--loop-base"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KVFLOW_CONFIG", raising=False)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_stat_of_a_pool_never_created_says_how_to_create_it(tmp_path, config, capsys):
    assert main(["pool", "stat", str(config)]) == 2
    assert "kvflow pool init" in capsys.readouterr().err


def test_bench_parts_produce_ratios_tables_and_a_figure(tmp_path):
    mib = 1 << 20
    results = {
        "striping": pool_bench.striping(64 * mib, (4, 1, 1), 6 * mib, 256 * 1024, 1, lambda s: None),
        "passthrough": pool_bench.passthrough(str(tmp_path), 4 * mib, 64 * 1024, 1, lambda s: None,
                                              global_drop=False),     # never drop the whole machine's cache
        "lookup": pool_bench.lookup(1024, 4096, 2, [None, 1e9], lambda s: None),
    }
    s = results["striping"]                    # the timed ratios are bench output; here what they are ratios of
    assert set(s["placements"]) == {"bandwidth", "equal", "overflow"}
    # where the records went is arithmetic, not timing: in proportion to 4:1:1, evenly, all on the fastest device
    assert s["placements"]["bandwidth"]["share"] == pytest.approx([4 / 6, 1 / 6, 1 / 6])
    assert s["placements"]["equal"]["share"] == pytest.approx([1 / 3] * 3)
    assert s["placements"]["overflow"]["share"] == pytest.approx([1, 0, 0])
    assert s["sum_individual"] == pytest.approx(sum(s["individual_bw"])) and len(s["individual_bw"]) == 3
    assert all(r["ratio_to_sum"] == pytest.approx(r["read_bw"] / s["sum_individual"]) for r in s["placements"].values())
    p = results["passthrough"]
    assert p["extent_over_files_bw"] == pytest.approx(p["extent"]["read_bw"] / p["files"]["read_bw"])
    assert all(link["share"] == pytest.approx(link["lookup_s"] / link["load_s"]) for link in results["lookup"]["links"])
    assert [title for title, _ in pool_bench.tables(results)]
    pool_bench.figure(results, tmp_path / "pool.png")
    assert (tmp_path / "pool.png").stat().st_size > 10_000
