"""A stage that dies or hangs ends the run with one clear line naming it, and leaves no process behind; bad
requests are refused before anything starts."""

from pathlib import Path

import pytest

from kvflow import KVPool, Restorer
from kvflow.errors import KVFlowError
from kvflow.pipeline import Pipeline, PipelineRun, shared_pool
from tests.restore.test_restore_exactness import ids, synthetic_cost

C = 32


@pytest.fixture(scope="module")
def stored(tiny):
    with shared_pool("32M", chunk_tokens=C) as cfg:
        pool = KVPool.open(cfg)
        restorer = Restorer(tiny, pool, cost=synthetic_cost(tiny))
        context = ids(200, 1)
        restorer.store(context, boundaries=[2])
        yield tiny, cfg, restorer.cost, context
        pool.close()


def workers_of(spec_dir: Path) -> list[int]:
    """Live processes started for this launch (their command line names its spec)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes()
            except OSError:
                continue
            if b"kvflow.pipeline.worker" in cmd and str(spec_dir).encode() in cmd:
                pids.append(int(proc.name))
    return pids


@pytest.mark.parametrize("action, expect", [
    ("kill", r"^pipeline stage 1 \(layers 2-3\) died with signal 9 \(SIGKILL\) at run 0 restore; "),
    ("hang", r"^pipeline did not finish within 60 s; still running: .*stage 1 \(layers 2-3\) at run 0 restore"),
])
def test_a_stage_that_dies_or_hangs_mid_run_ends_the_run_with_one_clear_error(stored, tmp_path, action, expect):
    runner, cfg, cost, context = stored
    pipe = Pipeline("tiny", runner.fingerprint, cfg, cost, timeout_s=60 if action == "hang" else 120,
                    faults={"stage": 1, "at": "run 0 restore", "action": action}, keep_dir=str(tmp_path))
    with pytest.raises(KVFlowError, match=expect) as err:
        pipe.run([PipelineRun(context, ids(3, 2), [(0, 2), (2, 4)])])
    assert "\n" not in str(err.value)
    assert workers_of(tmp_path) == [], "no stage outlives the run"


def test_a_stage_that_cannot_build_the_same_model_is_named(stored, tmp_path):
    runner, cfg, cost, context = stored
    pipe = Pipeline("tiny", "f" * 32, cfg, cost, keep_dir=str(tmp_path))
    with pytest.raises(KVFlowError, match=r"^pipeline stage \d failed at model: KVFlowError: model tiny built in "
                                          r"this stage differs from the parent's"):
        pipe.run([PipelineRun(context, ids(3, 2), [(0, 2), (2, 4)])])
    assert workers_of(tmp_path) == []


def test_bad_pipeline_requests_are_refused_before_anything_starts(stored):
    runner, cfg, cost, context = stored
    assert runner.num_layers == 4
    pipe = Pipeline("tiny", runner.fingerprint, cfg, cost)
    bad = [({"stages": [(0, 2), (3, 4)]}, "contiguous"), ({"stages": [(0, 2), (2, 5)]}, "contiguous"),
           ({"mode": "eager"}, "mode"), ({"strategy": "staircase"}, "strategy"), ({"query": []}, "query token"),
           ({"bandwidths": [1e6]}, "bandwidths")]
    for change, message in bad:
        run = PipelineRun(context, ids(3, 2), [(0, 2), (2, 4)])
        for k, v in change.items():
            setattr(run, k, v)
        with pytest.raises(KVFlowError, match=message):
            pipe.run([run])
    private = KVPool.memory("16M", chunk_tokens=C)
    with pytest.raises(KVFlowError, match="separate processes"):
        Pipeline("tiny", runner.fingerprint, private.cfg, cost).run([PipelineRun(context, ids(3, 2), [(0, 4)])])
