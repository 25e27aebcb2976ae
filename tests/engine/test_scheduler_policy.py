"""The remaining-work scheduling policy on synthetic queues (no model, no clock: a step counter). A short request
does not wait for others' long prefills, a long prompt is never passed over beyond starvation_factor x its FCFS
steps, decodes keep their token every step, and a pool hit is ranked by its predicted restoration."""

from dataclasses import dataclass
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.engine.block_manager import BlockManager
from kvflow.engine.config import EngineConfig
from kvflow.engine.sampling import SamplingParams
from kvflow.engine.scheduler import Scheduler, in_rank_order
from kvflow.engine.sequence import Sequence, Status


@dataclass(slots=True)
class Arrival:
    step: int
    prompt: int            # prompt tokens
    max_tokens: int = 1
    tokens: list[int] | None = None     # the prompt's ids (default: ``prompt`` copies of one id per request)


def run_queue(policy: str, arrivals: list[Arrival], budget: int = 256, num_blocks: int = 4096, factor: float = 4.0,
              pool_lookup=None, choose=None, max_steps: int = 10_000, trace: list | None = None, caching: bool = False):
    """Drive a Scheduler as the engine does, without a model: a sequence whose KV is complete gets a token at that
    step. Returns (first-token step per request, the sequences, per step the decoders that went without a token);
    ``trace`` gets the ids of the requests scheduled in each step; ``caching``: prefix caching on, computed blocks
    committed after each step (as the engine does)."""
    cfg = EngineConfig(block_size=16, max_num_batched_tokens=budget, scheduling_policy=policy,
                       starvation_factor=factor, enable_prefix_caching=caching)
    sched = Scheduler(cfg, BlockManager(num_blocks, 16, caching), pool_lookup, choose=choose)
    seqs = [Sequence(i, list(a.tokens or [i % 1000] * a.prompt), a.prompt,
                     SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)) for i, a in enumerate(arrivals)]
    first, skipped = {}, []
    for step in range(max_steps):
        for seq, a in zip(seqs, arrivals):
            if a.step == step:
                sched.add(seq)
        if step > max(a.step for a in arrivals) and not sched.has_unfinished():
            break
        decoding = [s for s in sched.running if s.first_token_s is not None and s.remaining == 1]
        out = sched.schedule()
        served = {id(s.seq) for s in out.scheduled}
        if trace is not None:
            trace.append({s.seq.seq_id for s in out.scheduled})
        skipped.append([s for s in decoding if id(s) not in served and s.status is Status.RUNNING])
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed = s.start + s.num_tokens
            seq.pool_restore = 0
            sched.blocks.commit(seq)
            if seq.num_computed == seq.num_tokens:
                if seq.first_token_s is None:
                    seq.first_token_s = float(step)
                    first[seq.seq_id] = step
                seq.token_ids.append(7)
                if seq.num_output >= seq.params.max_tokens:
                    sched.finish(seq)
    return first, seqs, skipped


def waited(first: dict, arrivals: list[Arrival]) -> list[int]:
    """Steps from arrival to first token, the arrival step counted."""
    return [first[i] - a.step + 1 for i, a in enumerate(arrivals)]


def test_a_short_request_behind_long_prefills_gets_its_first_token_in_the_step_it_arrives():
    arrivals = [Arrival(0, 4000) for _ in range(4)] + [Arrival(3, 100)]
    for policy, bound in (("remaining-work", 1), ("fcfs", None), ("first-token", None)):
        steps = waited(run_queue(policy, arrivals)[0], arrivals)
        if bound is not None:
            assert steps[-1] <= bound
        else:
            assert steps[-1] > 40           # FCFS: behind 16,000 prompt tokens at 256 a step
    # the long ones are interleaved with the short one, not stopped by it: the first finishes as under FCFS + 1 step
    rw, fcfs = (waited(run_queue(p, arrivals)[0], arrivals) for p in ("remaining-work", "fcfs"))
    assert rw[0] <= fcfs[0] + 1


def test_long_prefills_run_shortest_remaining_first_and_take_what_short_ones_leave():
    arrivals = [Arrival(0, 5000), Arrival(0, 1000), Arrival(0, 2000)]
    first, _, _ = run_queue("remaining-work", arrivals)
    assert first[1] < first[2] < first[0]
    assert first[0] == -(-8000 // 256) - 1            # no step left budget unused


def test_a_long_prompt_is_never_passed_over_beyond_the_starvation_factor():
    """A 4,000-token prompt and a stream of 240-token requests, one a step (budget 256): shortest-first alone would
    leave it 16 tokens a step until the stream ends."""
    arrivals = [Arrival(0, 4000)] + [Arrival(i, 240) for i in range(1, 120)]
    fcfs = waited(run_queue("fcfs", arrivals)[0], arrivals)
    for factor in (1.0, 2.0, 4.0):
        rw = waited(run_queue("remaining-work", arrivals, factor=factor)[0], arrivals)
        assert rw[0] <= factor * fcfs[0] + 1
    never = waited(run_queue("remaining-work", arrivals, factor=1e9)[0], arrivals)
    assert never[0] > 100                               # without aging: until the stream ends (FCFS: 16)


@settings(max_examples=60, deadline=None)
@given(queue=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 3000)), min_size=1, max_size=12),
       budget=st.integers(16, 512), factor=st.sampled_from([1.0, 1.5, 2.0, 4.0, 8.0]))
def test_every_request_gets_its_first_token_within_factor_times_its_fcfs_steps_plus_two(queue, budget, factor):
    arrivals = sorted((Arrival(step, n) for step, n in queue), key=lambda a: a.step)
    fcfs = waited(run_queue("fcfs", arrivals, budget=budget)[0], arrivals)
    rw = waited(run_queue("remaining-work", arrivals, budget=budget, factor=factor)[0], arrivals)
    for mine, theirs in zip(rw, fcfs):
        assert mine <= factor * theirs + 2


def test_decodes_are_never_starved_by_prefills_short_or_long():
    arrivals = ([Arrival(0, 50, max_tokens=60) for _ in range(6)] + [Arrival(2, 5000)]
                + [Arrival(s, 300, max_tokens=3) for s in range(3, 60, 2)])
    first, seqs, skipped = run_queue("remaining-work", arrivals, budget=128)
    assert not any(skipped)                          # every running decoder got its token in every step
    assert all(s.finished for s in seqs)


def test_a_pool_hit_is_ranked_by_its_predicted_restoration_not_its_length():
    """Two waiting prompts, 2,000 tokens with 1,984 in the pool and 600 with nothing cached: the restore costs less
    than the 600-token prefill (the predictor says so), so it is admitted first — and the other way round when the
    predictor prices the pool slower."""
    arrivals = [Arrival(0, 600), Arrival(0, 2000)]

    def lookup(token_ids):
        return 1984 if len(token_ids) >= 1999 else 0
    for restore_s, order in ((0.1, [1, 0]), (5.0, [0, 1])):
        def choose(n, resident, stored):
            if stored:
                return "restore", restore_s + (n - stored) * 1e-3
            return "prefill", (n - resident) * 1e-3                                     # 1 ms a prefill token
        cfg = EngineConfig(block_size=16, max_num_batched_tokens=4096, scheduling_policy="remaining-work")
        sched = Scheduler(cfg, BlockManager(1024, 16, False), lookup, choose=choose)
        seqs = [Sequence(i, [i + 1] * a.prompt, a.prompt, SamplingParams()) for i, a in enumerate(arrivals)]
        for s in seqs:             # distinct tokens: neither prompt is a prefix of the other (that one would wait)
            sched.add(s)
        assert [s.seq.seq_id for s in sched.schedule().scheduled] == order


def test_a_decoder_is_swapped_for_a_short_prompt_but_not_for_a_prefill_longer_than_its_answer():
    """A decoder with ~7 tokens to go holds blocks a newcomer needs. A 200-token newcomer (1 step of prefill) swaps it
    out; a 4,000-token one (16 steps at 256 a step) waits the decoder's few steps instead of stalling it 16."""
    def lookup(token_ids):
        return 0                                           # a pool, empty: swaps are possible
    for prompt, blocks, swaps in ((200, 14, 1), (4000, 252, 0)):
        arrivals = [Arrival(0, 64, max_tokens=8), Arrival(3, prompt)]
        first, seqs, _ = run_queue("remaining-work", arrivals, budget=256, num_blocks=blocks, pool_lookup=lookup)
        assert seqs[0].num_swaps == swaps and len(first) == 2
        if swaps == 0:
            assert first[1] >= 8                           # after the decoder's last token


def test_questions_about_32k_token_documents_do_not_wait_for_the_documents_prefill():
    """Issue 33's long-document QA at the scheduler: two 32K-token documents arrive first, then a short question
    every 8 steps. Each question gets its first token in the step it arrives; each document is still spread over
    at most F x its FCFS steps (512 tokens a step)."""
    arrivals = [Arrival(0, 32768), Arrival(0, 32768)] + [Arrival(s, 60, max_tokens=4) for s in range(1, 120, 8)]
    first, seqs, skipped = run_queue("remaining-work", arrivals, budget=512, num_blocks=8192)
    steps = waited(first, arrivals)
    assert all(w == 1 for w in steps[2:])
    fcfs = waited(run_queue("fcfs", arrivals, budget=512, num_blocks=8192)[0], arrivals)
    assert steps[0] <= fcfs[0] + 2 and steps[1] <= 4 * fcfs[1] + 2
    assert not any(skipped)


def test_a_request_on_a_document_being_prefilled_waits_for_that_prefill_instead_of_computing_it_again():
    """Two questions on one 1,000-token document arrive together with a question on a 3,000-token one: the second
    question on the first document is not admitted while the first question computes the document — it would
    compute the same KV — and the other document's question is admitted past it. (Nothing is cached in this
    synthetic queue, so the second question computes the document afterwards; what is pinned is the order.)"""
    doc, other = list(range(1000)), [5] * 3000
    arrivals = [Arrival(0, len(ids), tokens=ids) for ids in (doc + [1, 2], doc + [3, 4], other + [9])]
    steps = []
    _, seqs, _ = run_queue("remaining-work", arrivals, budget=1024, trace=steps)
    assert steps[0] == {0, 2}                                 # 2 admitted past 1, which waits for 0's prefill
    assert not any({0, 1} <= ids for ids in steps) and all(s.finished for s in seqs)


def test_a_prefill_that_requests_wait_on_is_not_starved_by_shorter_prompts():
    """A 600-token prompt on a document, three questions on that document one step later (they wait for its prefill,
    which computes their prefix), and two unrelated 100-token prompts every step. Ranked by its own work (344 tokens
    left after step 0) the document gets what the short prompts leave, 56 tokens a step: its first token at step 4,
    its questions' at step 5. Counted as work per request it lets through (344 / 4), it ranks with the short
    prompts and goes before the newer ones: done at step 2, its questions' first tokens at step 3."""
    doc = list(range(590))
    arrivals = ([Arrival(0, 600, tokens=doc + [1] * 10)]
                + [Arrival(1, 606, tokens=doc + [2 + q] * 16) for q in range(3)]
                + [Arrival(s, 100, tokens=[5000 + 2 * s + k] * 100) for s in range(1, 12) for k in range(2)])
    first, seqs, _ = run_queue("remaining-work", arrivals, budget=256, caching=True)
    assert all(s.finished for s in seqs)
    assert first[0] <= 2
    assert all(first[q] <= 3 for q in (1, 2, 3))
    assert [seqs[q].resident_hit_tokens for q in (1, 2, 3)] == [576] * 3     # they waited, nothing recomputed


def test_a_request_whose_prefix_became_resident_while_it_waited_is_ranked_by_what_is_left():
    """vLLM's prefix_repetition at the scheduler: a 2,048-token shared prefix, then a question on it every step. The
    questions that arrive while the first one computes the prefix wait for it (skipped, not admitted); once it is
    resident they need 48 tokens each, like every later question — and go before the later ones (arrival order
    among equals), not behind them at the 2,096 tokens they would have needed when they arrived."""
    prefix = list(range(2048))
    arrivals = [Arrival(s, 2096, max_tokens=2, tokens=prefix + [3000 + s] * 48) for s in range(12)]
    first, seqs, _ = run_queue("remaining-work", arrivals, budget=256, caching=True)
    assert all(s.finished for s in seqs)
    later = sorted(range(1, 12), key=lambda i: (first[i], i))
    assert later == list(range(1, 12))              # first tokens in arrival order once the prefix is resident
    assert [seqs[i].resident_hit_tokens for i in range(1, 12)] == [2048] * 11


def test_a_waiting_request_is_not_passed_over_by_later_requests_of_about_its_size():
    """Cold prompts of 330-345 tokens arriving one a step at a budget of 256: shortest-first alone hands every step
    to the newest prompt that is a few tokens shorter than those waiting, and the 345-token one waits until it is
    due. A request's passing allowance shrinks its rank as it is used, so a later prompt passes it only while it is
    sufficiently shorter (here: never after its first steps) — and first tokens come in arrival order."""
    arrivals = [Arrival(0, 345)] + [Arrival(s, 344 - s) for s in range(1, 14)]
    first, seqs, _ = run_queue("remaining-work", arrivals, budget=256)
    assert all(s.finished for s in seqs)
    fcfs = waited(run_queue("fcfs", arrivals, budget=256)[0], arrivals)
    mine = waited(first, arrivals)
    assert mine[0] <= fcfs[0] + 1
    assert max(m - f for m, f in zip(mine, fcfs)) <= 2


def test_prompts_of_about_one_size_keep_arrival_order_across_a_power_of_two():
    """A 520-token and then a 500-token cold prompt (budget 256): ranked by the power of two of their work, the later
    one (under 512) went first and the earlier waited for both — in the matrix's docqa cell a 434-token question
    waited behind a 431-token one that arrived 0.4 s after it. Within a factor of two the earlier goes first."""
    arrivals = [Arrival(0, 520), Arrival(0, 500), Arrival(1, 240)]
    first, _, _ = run_queue("remaining-work", arrivals)
    assert first[0] < first[1]
    assert first[2] <= first[0]                       # under half of both: it still passes them


@settings(max_examples=200, deadline=None)
@given(ranks=st.lists(st.tuples(st.sampled_from([0, 1, 1, 1, 2]), st.floats(0.001, 100.0)), min_size=1, max_size=30))
def test_a_later_request_passes_an_earlier_one_only_when_its_work_is_under_half_of_it(ranks):
    """The step's order on synthetic ranks (class, aged work, arrival): due requests first by arrival, those that have
    a token last by arrival, and among the ranked ones a later arrival ahead of an earlier one has under half its
    work; one under half of everything ranked before it goes first."""
    seqs = [SimpleNamespace(seq_id=i) for i in range(len(ranks))]
    table = {i: (cls, work, i) for i, (cls, work) in enumerate(ranks)}
    order = [s.seq_id for s in in_rank_order(seqs, table)]
    assert sorted(order) == list(range(len(ranks)))
    assert [table[i][0] for i in order] == sorted(table[i][0] for i in order)
    for cls in (0, 2):
        ids = [i for i in order if table[i][0] == cls]
        assert ids == sorted(ids)
    ranked = [i for i in order if table[i][0] == 1]
    for a, later in enumerate(ranked):
        for earlier in ranked[a + 1:]:
            if earlier < later:
                assert 2 * table[later][1] < table[earlier][1]
    if ranked:
        last = max(ranked)
        if all(2 * table[last][1] < table[i][1] for i in ranked if i != last):
            assert ranked[0] == last


def test_the_budget_cut_falls_on_the_later_arrival_when_either_would_finish_this_step():
    """A prompt with 200 tokens left and a 100-token request that arrives now (budget 256): either alone finishes in
    this step, both do not. Shortest-first would finish the newcomer and cut the older one to the next step; one of
    them waits a step either way, so the older one goes first. Two newcomers that both finish where the older one
    would take their room still go first (more first tokens this step), and one that cannot finish does not move."""
    arrivals = [Arrival(0, 456), Arrival(1, 100)]
    first, _, _ = run_queue("remaining-work", arrivals, budget=256)
    assert first == {0: 1, 1: 2}
    assert run_queue("fcfs", arrivals, budget=256)[0] == first
    two = [Arrival(0, 456), Arrival(1, 60), Arrival(1, 60)]
    first, _, _ = run_queue("remaining-work", two, budget=256)
    assert first == {0: 2, 1: 1, 2: 1}
    long = [Arrival(0, 556), Arrival(1, 100)]       # 300 left: it cannot finish in step 1 whatever goes first
    first, _, _ = run_queue("remaining-work", long, budget=256)
    assert first[1] == 1 and first[0] == 2


def test_a_pool_hit_over_a_resident_prefix_is_loaded_only_when_predicted_sooner_than_the_prefill_of_the_rest():
    """A 352-token prompt whose first 288 tokens are resident and 320 are in the pool. Its load of [288, 320) and the
    prefill after it priced at 1 s, the 64-token prefill from the resident hit (64 ms) wins and nothing is read;
    priced at 10 ms, the load wins (a load into the blocks, not a restoration: something is resident). Under every
    policy (admission is one rule)."""
    prompt = list(range(352))

    def lookup(token_ids):
        return 320 if len(token_ids) >= 320 else 0
    for load_s, expected in ((1.0, 0), (0.01, 320)):
        def choose(n, resident, stored):             # the soonest of a prefill from the resident blocks and a load
            ways = {"prefill": (n - resident) * 1e-3, **({"load": load_s} if stored else {})}
            way = min(ways, key=ways.get)
            return way, ways[way]
        for policy in ("remaining-work", "first-token", "fcfs"):
            cfg = EngineConfig(block_size=16, max_num_batched_tokens=512, scheduling_policy=policy)
            bm = BlockManager(64, 16, True)
            sched = Scheduler(cfg, bm, lookup, choose=choose)
            first = Sequence(0, prompt[:300], 300, SamplingParams(max_tokens=1))
            sched.add(first)
            sched.schedule()
            first.num_computed = 300
            bm.commit(first)                      # 18 blocks (288 tokens) resident
            sched.finish(first)
            seq = Sequence(1, prompt, 352, SamplingParams(max_tokens=1))
            sched.add(seq)
            out = sched.schedule()
            assert [s.seq for s in out.scheduled] == [seq]
            assert seq.num_computed == 288 and seq.pool_load == expected and seq.pool_restore == 0   # a load
            assert out.scheduled[0].start == (expected or 288)


def test_a_request_that_is_done_before_the_heads_blocks_are_free_passes_it_without_delaying_it():
    # A holds 25 of 40 blocks and decodes 40 tokens; B (16 blocks) waits for them; C (9 blocks, 2 tokens) ranks after
    # B (the same power of two, later) but fits beside A's growth and is done long before A frees B's blocks
    arrivals = [Arrival(0, 400, max_tokens=40), Arrival(3, 250), Arrival(4, 130, max_tokens=2)]
    first, _, _ = run_queue("remaining-work", arrivals, num_blocks=40)
    alone, _, _ = run_queue("remaining-work", arrivals[:2], num_blocks=40)
    assert first[2] == 4                                  # in the step it arrives
    assert first[1] == alone[1] > 40                      # B gets its blocks when A is done, as without C


def test_a_request_that_would_still_hold_its_blocks_when_the_heads_are_free_does_not_pass_it():
    # C's answer outlasts A's: admitted before B it could still hold blocks B needs when A is done
    arrivals = [Arrival(0, 400, max_tokens=40), Arrival(3, 250), Arrival(4, 130, max_tokens=60)]
    first, _, _ = run_queue("remaining-work", arrivals, num_blocks=40)
    assert first[2] >= first[1]


def test_decoders_sharing_a_prefix_are_swapped_together_when_only_both_make_room():
    # A and B share a 128-token prefix (8 blocks) and hold one block of their own each: swapped alone, either frees
    # one block; together they free ten — enough for C's 15, so C does not wait for their answers
    shared = list(range(128))
    arrivals = [Arrival(0, 144, max_tokens=30, tokens=shared + [500] * 16),
                Arrival(1, 144, max_tokens=30, tokens=shared + [600] * 16), Arrival(3, 240)]
    first, seqs, _ = run_queue("remaining-work", arrivals, num_blocks=22, pool_lookup=lambda ids: 0, caching=True)
    assert seqs[1].resident_hit_tokens == 128
    assert [s.num_swaps for s in seqs[:2]] == [1, 1]
    assert first[2] == 3
