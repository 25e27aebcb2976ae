"""Stage plans on synthetic cost models: one stage is the single-process planner; T* for S stages never exceeds a
prediction; activations are priced (they move the meet) and bound how far a stage may compute; the suggested
split is the best contiguous one and an uneven split is reported."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.cost import CostModel
from kvflow.errors import KVFlowError
from kvflow.planner import IOModel, Request
from kvflow.planner.pipeline import PipelinePlanner, even_split, parse_split, stage_rate
from kvflow.planner.predict import lower_bound

C, L = 256, 8
CELL = C * 1024 + 128


def cost_model(b=3e-8, layers=L) -> CostModel:
    return CostModel("synthetic", "0" * 32, 1, a=1e-4, b=b, d=4e-3, e=5e-4, head=0.02, kv_bytes_per_token_layer=1024,
                     num_layers=layers)


def planner(act_per_token=1024, b=3e-8) -> PipelinePlanner:
    return PipelinePlanner(cost_model(b), C, CELL, C * act_per_token + 128)


def links(p: PipelinePlanner, stages, rho: float) -> list[float]:
    return [rho * stage_rate(p.cost, hi - lo, C) for lo, hi in stages]


@settings(max_examples=40, deadline=None)
@given(rho=st.sampled_from([0.25, 1, 4]), n=st.integers(0, 48), b=st.floats(1e-9, 1e-7), q=st.integers(1, 300))
def test_one_stage_is_the_single_process_plan_and_bound(rho, n, b, q):
    p = planner(b=b)
    req = Request(n * C + 17, q, n)
    bw = links(p, [(0, L)], rho)
    plan = p.plan(req, [(0, L)], bw)
    expected = lower_bound(p.cost, IOModel(bw[0], CELL), n, C, L, plan.suffix, 1024)
    assert plan.lower_bound_s == pytest.approx(expected, rel=1e-9)
    assert plan.stages[0].inputs == "embed" and plan.stages[0].plan.layer_offset == 0


@settings(max_examples=60, deadline=None)
@given(rho=st.sampled_from([0.25, 1, 4]), n=st.integers(0, 48), cut=st.integers(1, L - 1),
       mode=st.sampled_from(["independent", "sequential"]), act=st.sampled_from([0, 256, 1024, 4096]),
       stored=st.integers(0, 48), strategy=st.sampled_from(["token", "cake", "load"]))
def test_the_s_stage_bound_never_exceeds_the_prediction_and_stage_plans_respect_their_inputs(
        rho, n, cut, mode, act, stored, strategy):
    p = planner(act)
    stages = [(0, cut), (cut, L)]
    plan = p.plan(Request(n * C, 16, n), stages, links(p, stages, rho), mode, [n, min(stored, n)], strategy)
    assert plan.lower_bound_s <= plan.predicted_ttft_s * (1 + 1e-9)
    for s in plan.stages:
        assert s.bound_s + p.cost.head <= plan.lower_bound_s * (1 + 1e-9)
        assert s.plan.layer_offset == s.layers[0] and s.plan.num_layers == s.layers[1] - s.layers[0]
        assert len(s.plan.split) == n
    s1 = plan.stages[1]
    if mode == "independent":
        assert s1.inputs == "act" and s1.act_chunks == min(stored, n)
        assert all(step.tokens[1] <= s1.act_chunks * C for step in s1.plan.compute), "no compute without inputs"
    else:
        assert s1.inputs == "handoff" and s1.handoff is False and plan.stages[0].handoff is True


def test_activations_ride_the_stages_own_link_and_are_priced():
    """Every recomputed chunk first moves its activation over the link the KV loads use: the I/O side advances
    more slowly, so the meet moves toward recompute and the stage takes longer."""
    free, dear = planner(act_per_token=0), planner(act_per_token=4096)
    stages, req = [(0, 4), (4, 8)], Request(64 * C, 16, 64)
    a = free.plan(req, stages, links(free, stages, 1))
    b = dear.plan(req, stages, links(dear, stages, 1))
    assert b.stages[1].plan.split.count(4) > a.stages[1].plan.split.count(4)
    assert b.stages[1].predicted_restore_s > a.stages[1].predicted_restore_s
    assert b.stages[1].bound_s > a.stages[1].bound_s
    assert b.stages[0].bound_s == a.stages[0].bound_s, "the first stage starts from embeddings"


def test_sequential_stages_wait_for_the_previous_stages_hidden_states():
    p = planner(act_per_token=128)
    stages, req = [(0, 4), (4, 8)], Request(64 * C, 16, 64)
    ind = p.plan(req, stages, links(p, stages, 1), "independent")
    seq = p.plan(req, stages, links(p, stages, 1), "sequential")
    assert seq.predicted_ttft_s > 1.15 * ind.predicted_ttft_s
    assert seq.stages[1].act_chunks == seq.stages[0].plan.split.count(4), "hand-off = what stage 0 recomputed"


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(2, 9), stages=st.integers(2, 3), n=st.integers(1, 24), act=st.sampled_from([0, 512, 4096]))
def test_the_suggested_split_is_the_best_contiguous_split(layers, stages, n, act):
    if stages > layers:
        return
    p = PipelinePlanner(cost_model(layers=layers), C, CELL, C * act + 128)
    req = Request(n * C, 8, n)
    bw = lambda k: stage_rate(p.cost, k, C)  # noqa: E731
    split = even_split(layers, stages)
    balance = p.balance(req, split, [bw(b - a) for a, b in split], bw)
    best = min(max(p.stage_restore_bound(req, s, bw(s[1] - s[0])) for s in cand)
               for cand in (list(zip((0, *cuts), (*cuts, layers)))
                            for cuts in itertools.combinations(range(1, layers), stages - 1)))
    assert balance.suggested_bound_s == pytest.approx(best)
    assert max(p.stage_restore_bound(req, s, bw(s[1] - s[0])) for s in balance.suggested) == pytest.approx(best)


def test_an_uneven_split_is_reported_and_the_balanced_one_favours_the_first_stage():
    p = planner(act_per_token=2048)
    req = Request(64 * C, 16, 64)
    bw = lambda k: stage_rate(p.cost, k, C)  # noqa: E731
    uneven = [(0, 1), (1, 8)]
    plan = p.plan(req, uneven, [bw(1), bw(7)], link_bandwidth=bw)
    assert plan.balance.unbalanced and plan.balance.imbalance > 3 and "UNBALANCED" in plan.describe()
    (_, cut), _ = plan.balance.suggested
    assert cut >= L // 2, "stage 0 needs no activations, so it can take more layers"
    assert plan.balance.gain > 0.3 and "would make the slowest stage" in plan.describe()
    best = p.plan(req, list(plan.balance.suggested), [bw(cut), bw(L - cut)], link_bandwidth=bw).balance
    assert best.gain == 0 and "no split of whole layers balances better" in best.describe()


def test_splits_are_parsed_and_checked():
    assert even_split(16, 3) == [(0, 6), (6, 11), (11, 16)]
    assert parse_split("5,3", 8) == [(0, 5), (5, 8)]
    for bad in ("5,4", "8,0", "a,b"):
        with pytest.raises(KVFlowError):
            parse_split(bad, 8)
    with pytest.raises(KVFlowError):
        even_split(2, 3)
    with pytest.raises(KVFlowError, match="mode"):
        planner().plan(Request(C, 1, 1), [(0, L)], [1e9], mode="eager")


def test_a_stage_plan_never_groups_its_last_loads():
    """A stage runs no query, so its meet has no last group (the executor asserts it): the stage plan turns the
    token plan's pipelined query off."""
    p = planner()
    plan = p.plan(Request(16 * C, 8, 16), [(0, L // 2), (L // 2, L)], links(p, [(0, L // 2), (L // 2, L)], 8))
    assert all(s.plan.dynamic_meet and not s.plan.pipelined_query and not s.plan.query_s for s in plan.stages)
