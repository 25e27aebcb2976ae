"""One way kvflow starts and stops a process of its own: a vLLM server, a Redis node, a `kvflow serve`, a stand-in.

    proc = Supervised(cmd, log_path=folder / "vllm.log", env=env, ready=http_ready(url + "/health"), name="vLLM")
    with proc.start(timeout_s=600):        # its own session (group id = its pid); polls ready() until the deadline
        ...                                # exits first, or never ready: one KVFlowError with the log's cause line
    # always: killpg(SIGTERM), wait; then killpg(SIGKILL): the whole group, workers the leader left behind included

Ready checks are plain callables (``http_ready``, ``port_ready`` or any ``() -> bool``), polled every ``poll_s``.
``find_venv`` is the one rule for a helper venv (vLLM's): explicit, else ``$ENV_VAR``, else NAME in the working
directory or the source tree kvflow runs from, holding a Python and every package asked for.

Why a module of its own at the package root: the product (vLLM integration, servers), the benchmarks and the tests
all start processes, and none of them should import another's folder to do it.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

from kvflow.errors import KVFlowError

Ready = Callable[[], bool]
SOURCE_ROOT = Path(__file__).resolve().parents[2]      # the checkout kvflow runs from (src/kvflow/..)


def http_ready(url: str, timeout_s: float = 2.0) -> Ready:
    """Ready when GET ``url`` answers 200."""
    def ready() -> bool:
        import httpx

        try:
            return httpx.get(url, timeout=timeout_s).status_code == 200
        except httpx.HTTPError:
            return False
    return ready


def port_ready(port: int, host: str = "127.0.0.1") -> Ready:
    """Ready when ``host:port`` accepts a TCP connection."""
    def ready() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1.0):
                return True
        except OSError:
            return False
    return ready


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def stop_group(pgid: int, wait: Callable[[float], bool], term_s: float = 10.0, kill_s: float = 10.0) -> None:
    """SIGTERM the group, ``wait(term_s)`` for its leader; SIGKILL what is left (at once when ``term_s`` is 0).
    ``wait(seconds)`` returns whether the leader has exited."""
    for sig, wait_s in ((signal.SIGTERM, term_s), (signal.SIGKILL, kill_s)):
        if wait_s <= 0:
            continue
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            break
        if not wait(wait_s):
            continue
        if not group_alive(pgid):
            break
        time.sleep(0.5)                             # the leader is gone: give its children a moment, then kill
    try:
        os.killpg(pgid, signal.SIGKILL)             # anything left of the group
    except ProcessLookupError:
        pass
    wait(kill_s)


class Supervised:
    """A command in its own process group, its output in ``log_path`` (or discarded), stopped as one group."""

    def __init__(self, args: Sequence[str], *, log_path: Path | None = None, env: dict | None = None,
                 ready: Ready | None = None, name: str = "the process", cwd: str | Path | None = None,
                 term_s: float = 10.0, poll_s: float = 0.5):
        self.args, self.log_path, self.env, self.ready = list(args), log_path, env, ready
        self.name, self.cwd, self.term_s, self.poll_s = name, cwd, term_s, poll_s
        self.proc: subprocess.Popen | None = None
        self.pid: int | None = None                 # kept after stop(): the group id it had

    def spawn(self) -> Supervised:
        """Start it without waiting."""
        assert self.proc is None
        if self.log_path is None:
            out = subprocess.DEVNULL
        else:
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            out = open(self.log_path, "wb")
        try:
            self.proc = subprocess.Popen(self.args, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.pid = self.proc.pid
        return self

    def start(self, timeout_s: float = 600.0) -> Supervised:
        """Spawn, then poll ``ready`` until it holds; on exit, deadline or interrupt stop the group and raise."""
        self.spawn()
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            code = self.proc.poll()
            if code is not None:
                raise KVFlowError(f"{self.name} exited with code {code} while starting; {self.failure()}")
            if self.ready is None or self.ready():
                return
            if time.monotonic() > deadline:
                raise KVFlowError(f"{self.name} was not healthy after {timeout_s:.0f} s; {self.failure()}")
            time.sleep(self.poll_s)

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, term_s: float | None = None) -> None:
        """TERM, then KILL the whole group; harmless when already stopped."""
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc.pid, lambda s: _waited(proc, s), self.term_s if term_s is None else term_s)

    def kill(self) -> None:
        """SIGKILL the group now (a crash, as tests and fault injection want it)."""
        self.stop(term_s=0)

    def log_tail(self, lines: int = 40) -> str:
        return log_tail(self.log_path, lines)

    def failure(self, lines: int = 4) -> str:
        """Its first error line (a server prints the cause above the tracebacks of its processes) and last lines."""
        if self.log_path is None:
            return "no log"
        try:
            text = [line.strip() for line in Path(self.log_path).read_text(errors="replace").splitlines()
                    if line.strip()]
        except OSError:
            return "no log"
        if not text:
            return f"{self.log_path} is empty"
        errors = [line for line in text if re.search(r"\b\w*(Error|Exception): ", line)]
        cause = f"cause: {errors[0][:400]} | " if errors else ""
        return f"{cause}last lines of {self.log_path}: " + " | ".join(line[:300] for line in text[-lines:])

    def __enter__(self) -> Supervised:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def log_tail(path: Path | None, lines: int = 40) -> str:
    """The last ``lines`` lines of a log, as written."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except (OSError, TypeError):
        return "(no log)"


def _waited(proc: subprocess.Popen, seconds: float) -> bool:
    try:
        proc.wait(timeout=seconds)
        return True
    except subprocess.TimeoutExpired:
        return False


def find_venv(name: str, explicit: str | Path | None = None, env_var: str | None = None,
              packages: Sequence[str] = ()) -> Path | None:
    """The helper venv: ``explicit``, else ``$env_var``, else ``name`` in the working directory or the source tree;
    None unless it holds ``bin/python`` and every one of ``packages`` (a package folder, dist-info or editable)."""
    if explicit is not None:
        candidates = [Path(explicit)]
    elif env_var and os.environ.get(env_var):
        candidates = [Path(os.environ[env_var])]
    else:
        candidates = [Path.cwd() / name, SOURCE_ROOT / name]
    for venv in candidates:
        if (venv / "bin" / "python").is_file() and all(_installed(venv, p) for p in packages):
            return venv
    return None


def _installed(venv: Path, package: str) -> bool:
    return any((site / package / "__init__.py").is_file() or any(site.glob(f"{package}-*.dist-info"))
               or any(site.glob(f"__editable__*{package}*"))
               for site in (venv / "lib").glob("python3*/site-packages"))


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While the block runs on the main thread, SIGTERM unwinds like Ctrl-C, so what it started is still stopped."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupt(signum, frame):
    """A signal handler that raises KeyboardInterrupt: ``finally`` blocks and ``with`` exits run."""
    raise KeyboardInterrupt(f"signal {signum}")
