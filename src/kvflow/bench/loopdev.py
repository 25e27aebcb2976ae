"""Block devices kvflow does not control, for `kvflow bench pool`: loop devices over sparse files, each capped by the
kernel — a cgroup v1 blkio throttle (read and write bytes/s per device) on a child cgroup this process joins for
the run. Nothing of the caps reaches kvflow: the pool sees raw /dev/loopN and must probe them.

    with CappedLoops(folder, size, read_caps, write_caps) as rig:    # mkdir cgroup, join it, attach + cap devices
                                                                       # (or rig.start() first to handle set-up errors)
        rig.devices                 # [LoopDevice(path=/dev/loop3, ...), ...]  (device i capped at read_caps[i])
        rig.renew()                 # fresh, empty devices with the same caps (for the next pool)
    # always, also on an exception, Ctrl-C or SIGTERM: back to the old cgroup, losetup -d, rmdir, files removed

Needs root, losetup + /dev/loop-control and the cgroup v1 blkio controller; ``unavailable()`` says which is missing.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvflow.supervisor import interrupt

BLKIO = Path("/sys/fs/cgroup/blkio")
log = logging.getLogger("kvflow.bench")


def unavailable() -> str | None:
    """Why capped loop devices cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (losetup, cgroup writes)"
    if shutil.which("losetup") is None or not Path("/dev/loop-control").exists():
        return "no loop devices (losetup or /dev/loop-control missing)"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return f"no cgroup v1 blkio controller with throttling at {BLKIO}"
    return None


@dataclass(slots=True)
class LoopDevice:
    path: str          # /dev/loopN
    file: str          # its sparse backing file
    rdev: str          # "major:minor", what the blkio rules name
    read_cap: int      # bytes/s the kernel allows this process
    write_cap: int | None


def blkio_group_of_self() -> str:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "blkio" in controllers.split(","):
            return path
    return "/"


def _losetup(*args: str) -> str:
    run = subprocess.run(["losetup", *args], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        raise OSError(f"losetup {' '.join(args)}: {run.stderr.strip() or run.returncode}")
    return run.stdout.strip()


class CappedLoops:
    def __init__(self, folder: str, size: int, read_caps: list[int], write_caps: list[int] | None = None):
        self.folder, self.size = folder, size
        self.read_caps, self.write_caps = list(read_caps), list(write_caps) if write_caps else None
        self.devices: list[LoopDevice] = []
        self.cgroup: Path | None = None
        self._home = blkio_group_of_self()
        self._tmp: str | None = None
        self._joined = False
        self._old_sigterm = None
        self._generation = 0

    # -- set-up ---------------------------------------------------------------------------------------------
    def __enter__(self) -> CappedLoops:
        return self if self.cgroup is not None else self.start()

    def start(self) -> CappedLoops:
        """Set up (what ``with`` does); an OSError here leaves nothing behind."""
        if threading.current_thread() is threading.main_thread():
            self._old_sigterm = signal.signal(signal.SIGTERM, interrupt)   # SIGTERM tears down like Ctrl-C
        try:
            self._tmp = tempfile.mkdtemp(prefix="kvflow-loops-", dir=self.folder)
            self.cgroup = BLKIO / f"kvflow-bench-{os.getpid()}-{int(time.time())}"
            self.cgroup.mkdir()
            (self.cgroup / "cgroup.procs").write_text(f"{os.getpid()}\n")   # every thread of this process
            self._joined = True
            self._attach()
        except BaseException:
            self._teardown()
            raise
        return self

    def _attach(self) -> None:
        self._generation += 1
        for i, cap in enumerate(self.read_caps):
            file = os.path.join(self._tmp, f"dev{i}-{self._generation}.img")
            with open(file, "wb") as f:
                f.truncate(self.size)                      # sparse: only what the pools write takes disk space
            path = _losetup("--find", "--show", "--direct-io=on", "--sector-size", "4096", file)
            st = os.stat(path)
            dev = LoopDevice(path, file, f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}", cap,
                             self.write_caps[i] if self.write_caps else None)
            self.devices.append(dev)
            self._rule("read", dev.rdev, dev.read_cap)
            if dev.write_cap:
                self._rule("write", dev.rdev, dev.write_cap)

    def _rule(self, direction: str, rdev: str, bps: int) -> None:
        (self.cgroup / f"blkio.throttle.{direction}_bps_device").write_text(f"{rdev} {int(bps)}\n")

    def renew(self) -> list[LoopDevice]:
        """Detach every device and attach fresh, empty ones with the same caps."""
        self._detach()
        self._attach()
        return self.devices

    # -- tear-down ------------------------------------------------------------------------------------------
    def _detach(self) -> None:
        errors = []
        for dev in self.devices:
            for direction in ("read", "write"):
                try:
                    self._rule(direction, dev.rdev, 0)     # 0 removes the rule
                except OSError:
                    pass
            try:
                _losetup("-d", dev.path)
            except OSError as err:
                errors.append(str(err))
            try:
                os.unlink(dev.file)
            except OSError:
                pass
        self.devices = []
        if errors:
            raise OSError("; ".join(errors))

    def __exit__(self, exc_type, *_exc) -> None:
        problems = self._teardown()
        if problems:
            message = "capped loop devices: tear-down incomplete: " + "; ".join(problems)
            if exc_type is not None:           # do not hide the error that got us here
                log.error(message)
            else:
                raise OSError(message)

    def _teardown(self) -> list[str]:
        problems = []
        if self._joined:
            try:
                (BLKIO / self._home.lstrip("/") / "cgroup.procs").write_text(f"{os.getpid()}\n")
                self._joined = False
            except OSError as err:
                problems.append(f"leaving {self.cgroup}: {err}")
        try:
            self._detach()
        except OSError as err:
            problems.append(str(err))
        if self.cgroup is not None and self.cgroup.exists():
            for _ in range(50):                            # the kernel may report busy for a moment after we left
                try:
                    self.cgroup.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
            else:
                problems.append(f"could not remove {self.cgroup}")
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        return problems
