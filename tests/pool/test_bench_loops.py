"""`kvflow bench pool` on devices kvflow does not control: the kernel-capped loop rig always tears down (also when
the run fails), a machine without root / loop devices / cgroup v1 blkio gets one note instead of a failure, and the
mixed pool (memory + an extent file) reports its ratio. Speeds are bench output, never asserted here."""

import os
from pathlib import Path

import pytest

from kvflow.bench import loopdev, pool_bench
from kvflow.bench.pool_loop import LoopOptions, kernel_capped_loops, mixed

MiB = 1 << 20


def test_without_capped_loops_the_section_is_one_note_and_the_report_still_renders(monkeypatch, tmp_path):
    monkeypatch.setattr(loopdev, "unavailable", lambda: "needs root (losetup, cgroup writes)")
    results = {"loops": kernel_capped_loops(LoopOptions(), str(tmp_path), lambda s: None)}
    assert results["loops"] == {"skipped": "kernel-capped loop devices skipped: needs root (losetup, cgroup writes)"}
    assert pool_bench.summary(results)["loops"].startswith("kernel-capped loop devices skipped")
    (title, rows), = pool_bench.tables(results)
    assert "skipped: needs root" in title and rows == []
    pool_bench.figure(results, tmp_path / "pool.png")          # nothing to draw: no figure, no error


def test_a_rig_that_cannot_be_set_up_is_a_note_too(monkeypatch, tmp_path):
    monkeypatch.setattr(loopdev, "unavailable", lambda: None)

    def refuse(self):
        raise OSError("losetup --find: could not find any free loop device")
    monkeypatch.setattr(loopdev.CappedLoops, "start", refuse)
    out = kernel_capped_loops(LoopOptions(data_bytes=8 * MiB), str(tmp_path), lambda s: None)
    assert out == {"skipped": "kernel-capped loop devices skipped: could not set them up "
                              "(losetup --find: could not find any free loop device)"}


needs_rig = pytest.mark.skipif(loopdev.unavailable() is not None, reason=f"{loopdev.unavailable()}")


def _attached(file: str) -> bool:
    return file in os.popen("losetup -a").read()


@needs_rig
def test_the_rig_caps_only_this_process_and_tears_everything_down_even_when_the_run_fails(tmp_path):
    home = loopdev.blkio_group_of_self()
    seen = {}
    with pytest.raises(RuntimeError, match="the run failed"):
        with loopdev.CappedLoops(str(tmp_path), 8 * MiB, [20 * MiB, 40 * MiB], [20 * MiB, 40 * MiB]) as rig:
            seen["cgroup"], seen["files"] = rig.cgroup, [d.file for d in rig.devices]
            assert str(os.getpid()) in (rig.cgroup / "cgroup.procs").read_text().split()
            rules = (rig.cgroup / "blkio.throttle.read_bps_device").read_text()
            assert all(f"{d.rdev} {d.read_cap}" in rules for d in rig.devices)
            assert all(_attached(f) for f in seen["files"])
            seen["files"] += [d.file for d in rig.renew()]
            raise RuntimeError("the run failed")
    assert not seen["cgroup"].exists()
    assert not any(_attached(f) for f in seen["files"]) and not any(Path(f).exists() for f in seen["files"])
    assert str(os.getpid()) in (loopdev.BLKIO / home.lstrip("/") / "cgroup.procs").read_text().split()


def test_the_mixed_pool_reports_each_device_alone_and_the_striped_ratio(tmp_path):
    m = mixed(str(tmp_path), 8 * MiB, MiB, 1, lambda s: None)
    assert len(m["probed_read_bw"]) == 2 and sum(m["share"]) == pytest.approx(1.0)
    assert m["ratio_to_sum"] == pytest.approx(m["read_bw"] / sum(m["pool_alone_bw"]))
    (title, rows), = pool_bench.tables({"mixed": m})
    assert [r["device"] for r in rows] == ["memory", "extent (disk)", "striped (both)"]


@needs_rig
def test_sigterm_during_a_run_still_tears_the_rig_down(tmp_path):
    import subprocess
    import sys
    import textwrap
    script = textwrap.dedent(f"""
        import os, signal, time
        from kvflow.bench import loopdev
        with loopdev.CappedLoops({str(tmp_path)!r}, 8 << 20, [20 << 20]) as rig:
            print(rig.cgroup, rig.devices[0].file, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "KeyboardInterrupt" in run.stderr
    cgroup, file = run.stdout.split()
    assert not Path(cgroup).exists() and not _attached(file) and not Path(file).exists()
