"""Generated bad input for every entry point a user types into: pool configs (YAML, keys of any type), command-line
arguments (model names, dtypes, and every numeric or list option of the demo, profile and bench commands) and
``KVFLOW_*`` environment values, plus damaged checkpoints and cost profiles on disk. ``run_case`` runs one case
in-process through ``kvflow.cli.main.main`` (the same code path as the shell) and returns what a user would see.

Commands that would start real work once their input is accepted (profiling, a restore) stop at that point with
``Reached``: the property is about input handling, and a valid demo takes minutes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml
from hypothesis import strategies as st

# Values a user might type where a number, size, flag or path is expected (valid ones among them).
WILD_TEXT = ["infG", "inf", "-inf", "nan", "NaN", "abc", "", " ", "-1", "0", "1e30", "1.5", "1e-300",
             "99999999999999999999999", "0x10", "1M", "2M", "  1M ", "true", "null", "1_000", "4k", "-0", "1e3",
             "１２", "1M1", "M", "1.5.5", "\x00", "ᴵ", "1G" * 40]
WILD = st.one_of(st.sampled_from(WILD_TEXT), st.integers(-2**70, 2**70), st.floats(),
                 st.booleans(), st.none(), st.lists(st.integers(0, 9), max_size=2),
                 st.dictionaries(st.sampled_from(["a", "type", "x"]), st.integers(0, 9), max_size=2),
                 st.text(max_size=6))
# Device capacities: small valid ones or values that must be refused (a huge valid capacity would really be
# allocated or zero-filled by a pool that accepted it; those belong to the ENOSPC trials of the campaign).
CAPACITY = st.one_of(st.sampled_from([4096, "1M", "2M", "3M", "1.5M", 1 << 20, "infG", "inf", "abc", -1, 0, "1e30",
                                      1.5, "nan", "", None, [1], {"a": 1}, True, "-2M", "99999999999999999999999G"]),
                     st.integers(-2**70, 0))
POOL_FIELDS = {"chunk_tokens": 16, "durability": "strict", "storage_dtype": "float32", "placement": "bandwidth",
               "checkpoint_interval_s": 5.0, "wal_compact_bytes": "4M", "high_watermark": 0.95,
               "low_watermark": 0.85, "probe_bytes": "1M"}
DEVICE_FIELDS = {"bandwidth": None, "throttle": None, "workers": 2, "direct": True, "zero_fill": True,
                 "drop_cache": True}
PATHS = ["d.img", "d2.img", "files", "afile/d.img", "afile", ".", "/dev/null", "missing/deep/d.img", "", "shm0"]
TORCH_THREADS = ["abc", "99999", "0", "-1", "2", "", " 1 ", "1.5", "inf", "2" * 30]
ENV_NAMES = ["KVFLOW_POOL_DURABILTY", "KVFLOW_TORCH_THREAD", "KVFLOW_HOM", "KVFLOW_POOL_CHECKPOINT_INTERVAL",
             "KVFLOW_CONFIGG", "KVFLOW_PLANER_MAX_STEP", "KVFLOW_"]


class Reached(Exception):
    """The command accepted its input and was about to start real work."""


@dataclass
class Case:
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    config: object = None                 # written to ./kvflow.yaml (YAML) when not None
    profile: object = None                # written as tiny's saved cost profile when not None
    files: dict[str, str] = field(default_factory=dict)   # relative path -> content ("<dir>" makes a folder)


@dataclass
class Outcome:
    rc: int | None
    stdout: str
    stderr: str
    raised: BaseException | None = None
    reached: bool = False

    def problems(self, allowed=(0, 2)) -> list[str]:
        """Everything a user must never see: a raised exception, a traceback, an unexpected exit code, an exit 2
        without exactly one ``error:`` line as the last line of stderr."""
        out = []
        if self.raised is not None:
            out.append(f"raised {type(self.raised).__name__}: {self.raised}")
        if "Traceback" in self.stderr or "Traceback" in self.stdout:
            out.append("printed a traceback")
        if not self.reached and self.rc not in allowed:
            out.append(f"exit code {self.rc}")
        if self.rc == 2:
            lines = [ln for ln in self.stderr.splitlines() if ln.strip()]
            errors = [ln for ln in lines if ln.startswith("error:")]
            if len(errors) != 1 or lines[-1] != errors[0]:
                out.append(f"exit 2 without exactly one final error line: {lines[-3:]}")
        return out


# -- strategies --------------------------------------------------------------------------------------------------
VALID_DEVICES = [{"type": "extent", "path": "d.img", "capacity": "2M", "workers": 2},
                 {"type": "files", "path": "files", "capacity": "1M"},
                 {"type": "memory", "path": "shm0", "capacity": "1M"},
                 {"type": "memory", "capacity": "1M"},
                 {"type": "extent", "path": "d2.img", "capacity": "1M", "zero_fill": False, "direct": False}]


@st.composite
def pool_configs(draw):
    """A valid pool config, then 0-3 mutations (a wild value, a dropped or unknown key, a bad path ...), so both
    accepted and refused configs are common."""
    cfg: dict = {"index_dir": "idx", **{k: v for k, v in POOL_FIELDS.items() if draw(st.booleans())}}
    picks = draw(st.lists(st.integers(0, len(VALID_DEVICES) - 1), min_size=1, max_size=3, unique=True))
    devices = [dict(VALID_DEVICES[i]) for i in picks]
    replaced = None
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        what = draw(st.integers(0, 10))
        if what == 0:
            cfg[draw(st.sampled_from(sorted(POOL_FIELDS)))] = draw(WILD)
        elif what == 1:
            cfg["index_dir"] = draw(st.sampled_from(["afile/idx", None, "", 5, "/dev/null", "."]))
        elif what <= 3:
            dev = draw(st.sampled_from(devices))
            dev[draw(st.sampled_from(sorted(DEVICE_FIELDS)))] = draw(WILD)
        elif what == 4:
            draw(st.sampled_from(devices))["capacity"] = draw(CAPACITY)
        elif what == 5:
            draw(st.sampled_from(devices))["path"] = draw(st.sampled_from(PATHS))
        elif what == 6:
            draw(st.sampled_from(devices))["type"] = draw(st.sampled_from(["bogus", 3, None, "extent", "files"]))
        elif what == 7:
            dev = draw(st.sampled_from(devices))
            if dev:
                dev.pop(draw(st.sampled_from(sorted(dev))))
        elif what == 8:
            target = draw(st.sampled_from([cfg, draw(st.sampled_from(devices))]))
            target[draw(st.sampled_from(["colour", "devise", "capacty", 1, 2.5, None, True]))] = 1   # unknown key
        elif what == 9:
            replaced = draw(st.sampled_from([[], devices * 2, [{}], "extent", None]))
        else:                                           # a remote store nobody answers at (issue 36, storage)
            devices.append({"type": "remote", "url": "redis://127.0.0.1:1", "timeout_s": 0.2,
                            "cluster": draw(st.booleans())})
    cfg["devices"] = devices if replaced is None else replaced
    top = draw(st.integers(0, 29))
    if top == 0:
        return draw(WILD)                               # not even a mapping
    return {"pool": cfg} if top > 3 else cfg


@st.composite
def envs(draw) -> dict[str, str]:
    env = {}
    if draw(st.integers(0, 5)) == 0:
        env["KVFLOW_TORCH_THREADS"] = draw(st.sampled_from(TORCH_THREADS))
    if draw(st.integers(0, 5)) == 0:
        name = draw(st.sampled_from(sorted(POOL_FIELDS) + ["devices", "index_dir"]))
        env[f"KVFLOW_POOL_{name.upper()}"] = draw(st.sampled_from(WILD_TEXT))
    if draw(st.integers(0, 5)) == 0:
        env[draw(st.sampled_from(ENV_NAMES))] = draw(st.sampled_from(WILD_TEXT))
    if draw(st.integers(0, 7)) == 0:
        env["KVFLOW_HOME"] = draw(st.sampled_from(["afile/home", "home", "/dev/null"]))
    if draw(st.integers(0, 7)) == 0:
        env["KVFLOW_PLANNER_MAX_STEP"] = draw(st.sampled_from(WILD_TEXT))
    return {k: v.replace("\x00", "") for k, v in env.items()}


def _num(draw) -> str:
    return str(draw(st.one_of(st.sampled_from(WILD_TEXT), st.integers(-2**40, 2**40))))


@st.composite
def pool_cases(draw) -> Case:
    cmd = draw(st.sampled_from(["init", "stat", "probe", "fsck"]))
    argv = ["pool", cmd]
    if draw(st.integers(0, 4)):
        argv.append(draw(st.sampled_from(["kvflow.yaml"] * 6 + ["missing.yaml", "afile", "."])))
    if cmd == "probe" and draw(st.booleans()):
        argv += ["--size", _num(draw)]
    if cmd == "stat" and draw(st.booleans()):
        argv.append("--json")
    if cmd == "fsck" and draw(st.booleans()):
        argv += draw(st.sampled_from([["--dry-run"], ["--rebuild"], ["--rebuild", "--dry-run"]]))
    if cmd == "init" and draw(st.integers(0, 3)) == 0:
        argv.append("--force")           # formats only what the case's folder holds (special files are refused)
    if draw(st.integers(0, 9)) == 0:
        argv.append(draw(st.sampled_from(["--bogus", "--size", "extra"])))
    if draw(st.integers(0, 2)) == 0:                    # a pool that already exists
        argv = ["pool", "init", "kvflow.yaml", "&&"] + argv
    return Case(argv, draw(envs()), config=draw(pool_configs()))


MODELS = ["tiny", "tiny", "tiny", "tiny@layers=2", "ck", "ck", "tiny@layers=0", "tiny@layers=99", "tiny@lay=1", "nosuch", "ck", "ck-truncated",
          "ck-noweights", "ck-badconfig", "/no/such/dir", "afile", "", "tiny@", "tiny@layers=²", "tiny@layers=１",
          "tiny@@", "@"]
DTYPES = ["float32", "bfloat16", "float8", "", "fp16", "int3", "bf16", "float16"]
# Numbers where a count, ratio, rate or seed is expected: the limits' edges and what lies past them.
NUMBERS = ["0", "-4", "nan", "inf", "-inf", "1e400", "99999999999999999999", "9223372036854775808", "abc", "",
           "0.5", "1", "2", "1000", "1001", "10", "11", "256", "257"]
# The other commands with numeric or list options: (argv, options). Each stops at its real work (``Reached``).
BENCHES = [
    (["demo", "restore", "--model", "tiny"], ["--rho", "--context", "--query"]),
    (["demo", "--model", "tiny"], ["--users", "--rounds", "--rate", "--think", "--kv-share", "--repeats", "--seed",
                                   "--system-tokens"]),
    (["bench", "pool"], ["--record-kib", "--loop-caps", "--loop-base", "--loop-data"]),
    (["bench", "restore", "--model", "tiny"], ["--rho", "--lengths", "--latency", "--gbps", "--batch", "--context",
                                               "--query", "--repeats"]),
    (["bench", "second-turn", "--model", "tiny"], ["--rho", "--history", "--chunk-tokens", "--seed", "--repeats"]),
    (["bench", "pipeline", "--model", "tiny"], ["--rho", "--stages", "--threads", "--timeout", "--seed", "--chunk",
                                                "--context"]),
    (["bench", "decode", "--model", "tiny"], ["--sequences", "--prompt-len", "--max-tokens", "--repeats"]),
    (["bench", "serve", "--model", "tiny", "--users", "1", "--rounds", "1"],
     ["--rate", "--think", "--kv-share", "--rho", "--block-size", "--chunk-tokens", "--max-batched", "--repeats",
      "--seed", "--users"]),
    (["bench", "soak", "--model", "tiny"], ["--clients", "--duration", "--seed"]),
    (["bench", "shared"], ["--caps", "--tokens"]),
    (["bench", "elastic", "--model", "tiny"], ["--budgets", "--long-len", "--gap", "--seed", "--repeats"]),
    (["profile", "tiny"], ["--seed", "--max-position", "--repeats"]),
]
# Where each of those commands starts its real work.
WORK = ["kvflow.bench.pool_bench.run", "kvflow.bench.pipeline_bench.run", "kvflow.bench.shared_bench.run",
        "kvflow.bench.restore_bench.make_bench", "kvflow.bench.second_turn.run_second_turn",
        "kvflow.bench.serve_bench.batched_decode", "kvflow.demo.run.run_demo", "kvflow.bench.elastic_bench.run",
        "kvflow.server.process.ServerProcess", "kvflow.bench.serve_run.run_chat",
        "kvflow.bench.serve_bench.run_soak", "kvflow.bench.bound.recompute_rate",
        "kvflow.model.host_memory.hold_to_live_set", "kvflow.bench.connector_bench.run"]


@st.composite
def bench_cases(draw) -> Case:
    argv, options = draw(st.sampled_from(BENCHES))
    argv = list(argv)
    for opt in draw(st.lists(st.sampled_from(options), min_size=1, max_size=3, unique=True)):
        value = draw(st.one_of(st.sampled_from(NUMBERS), st.sampled_from(NUMBERS).map(lambda v: f"{v},1")))
        argv += [opt, value]
    return Case(argv)


@st.composite
def model_cases(draw) -> Case:
    kind = draw(st.sampled_from(["demo", "profile", "show", "bench"]))
    model = draw(st.sampled_from(MODELS))
    profile = None
    if kind == "demo":
        argv = ["demo", "restore", "--model", model]
        for opt in ("--context", "--query", "--rho"):
            if draw(st.integers(0, 2)) == 0:
                argv += [opt, _num(draw) if draw(st.booleans()) else
                         draw(st.sampled_from(["300000000", "262145", "4096", "1e9", "0.5", "512", "2"]))]
        if draw(st.booleans()):
            argv += ["--dtype", draw(st.sampled_from(DTYPES))]
    elif kind == "profile":
        argv = ["profile", model]
        for opt in ("--max-position", "--repeats", "--seed"):
            if draw(st.integers(0, 2)) == 0:
                argv += [opt, _num(draw) if draw(st.booleans()) else draw(st.sampled_from(["256", "1", "2", "4096"]))]
        if draw(st.booleans()):
            argv += ["--dtype", draw(st.sampled_from(DTYPES))]
        if draw(st.booleans()):
            argv += ["--out", draw(st.sampled_from(["p.json", "afile/p.json", "home/x/p.json", "."]))]
    elif kind == "show":
        argv = ["profile", "tiny", "--show"]
        profile = draw(profiles())
    else:
        argv = ["bench", "restore", "--model", model]
        for opt in ("--rho", "--lengths", "--batch", "--context", "--repeats"):
            if draw(st.booleans()):
                argv += [opt, draw(st.sampled_from(["1,2", "a,b", "", ",", "-1", "0", "1e400", "nan", "8", "3,x"]))]
    return Case(argv, draw(envs()), profile=profile)


@st.composite
def profiles(draw):
    good = {"model": "tiny", "fingerprint": "f" * 32, "threads": 2, "a": 1e-6, "b": 1e-9, "d": 1e-4, "e": 1e-3,
            "head": 1e-3, "kv_bytes_per_token_layer": 512, "num_layers": 4, "fit": {"max_position": 8192}}
    roll = draw(st.integers(0, 9))
    if roll == 0:
        return draw(st.sampled_from(["", "{", "[]", "null", "\x00\x01", "not json"]))
    if roll == 1:
        return draw(WILD)
    data = dict(good)
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(good) + ["extra"]))
        if draw(st.integers(0, 4)) == 0:
            data.pop(key, None)
        else:
            data[key] = draw(WILD)
    return data


def cases():
    return st.one_of(pool_cases(), model_cases(), bench_cases())


# -- running one case --------------------------------------------------------------------------------------------
def _checkpoints(root: Path, source: Path) -> None:
    """Good and damaged copies of a saved tiny checkpoint."""
    shutil.copytree(source, root / "ck")
    shutil.copytree(source, root / "ck-truncated")
    with open(root / "ck-truncated" / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    shutil.copytree(source, root / "ck-noweights")
    (root / "ck-noweights" / "model.safetensors").unlink()
    shutil.copytree(source, root / "ck-badconfig")
    (root / "ck-badconfig" / "config.json").write_text('{"model_type": "llama", "hidden_size": "big"')


def _write(root: Path, case: Case, profile_name: str) -> None:
    (root / "afile").write_text("a file, not a folder\n")
    if case.config is not None:
        (root / "kvflow.yaml").write_text(yaml.safe_dump(case.config, allow_unicode=True, sort_keys=False))
    if case.profile is not None:
        folder = root / "home" / "profiles"
        folder.mkdir(parents=True, exist_ok=True)
        text = case.profile if isinstance(case.profile, str) else json.dumps(case.profile, default=str)
        (folder / profile_name).write_text(text)


@contextlib.contextmanager
def _environment(root: Path, env: dict[str, str]):
    saved = dict(os.environ)
    cwd, threads = os.getcwd(), torch.get_num_threads()
    for k in [k for k in os.environ if k.startswith("KVFLOW_")]:
        del os.environ[k]
    os.environ["KVFLOW_HOME"] = str(root / "home")
    os.environ.update({k: (str(root / v) if k == "KVFLOW_HOME" and not v.startswith("/") else v)
                       for k, v in env.items()})
    os.chdir(root)
    try:
        yield
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
        torch.set_num_threads(threads)


def run_case(case: Case, root: Path, checkpoint: Path, profile_name: str) -> list[Outcome]:
    """Run ``case`` in a fresh folder ``root``; one Outcome per command (``&&`` chains two)."""
    import pytest

    from kvflow.cli import main as cli

    cli._register()
    _checkpoints(root, checkpoint)
    _write(root, case, profile_name)

    def reached(*args, **kwargs):
        raise Reached()

    commands, cur = [], []
    for arg in case.argv:
        if arg == "&&":
            commands.append(cur)
            cur = []
        else:
            cur.append(arg)
    commands.append(cur)
    outcomes = []
    with pytest.MonkeyPatch.context() as mp, _environment(root, case.env):
        mp.setattr("kvflow.cli.restore_cmds.ensure_cost", reached)
        mp.setattr("kvflow.cost.profile", reached)
        for work in WORK:
            mp.setattr(work, reached)
        for argv in commands:
            out, err = io.StringIO(), io.StringIO()
            rc, raised, got_there = None, None, False
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                try:
                    rc = cli.main(list(argv))
                except Reached:
                    got_there = True
                except SystemExit as ex:       # fsck's "found bad records" exit
                    rc = ex.code if isinstance(ex.code, int) else 1
                except BaseException as ex:    # noqa: BLE001 — anything else is exactly what the test looks for
                    raised = ex
            outcomes.append(Outcome(rc, out.getvalue(), err.getvalue(), raised, got_there))
    return outcomes
