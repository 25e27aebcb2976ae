"""On a real, trained model (SmolLM2-135M-Instruct) the engine serves a multi-user, multi-turn chat in its own chat
template exactly: greedy tokens equal transformers' generate, through a resident prefix hit and a history that was
evicted and comes back from the pool."""

from kvflow import KVPool, Restorer
from kvflow.engine import EngineConfig, LLMEngine, SamplingParams
from tests.engine.helpers import hf_greedy, synthetic_cost
from tests.texts import DECLARATION, GETTYSBURG, KITCHEN

MAX = 12


def test_a_multi_turn_chat_on_real_weights_equals_generate(smollm2, smollm2_tokenizer):
    tok = smollm2_tokenizer
    restorer = Restorer(smollm2, KVPool.memory("128M", chunk_tokens=32), cost=synthetic_cost(smollm2),
                        calibrate=False)
    # 32 blocks of 16 tokens: one ~370-token history at a time; the next users' prompts evict it
    engine = LLMEngine(smollm2, EngineConfig(block_size=16, num_blocks=32, max_num_batched_tokens=128,
                                             activation_reserve=64 * 2**20), restorer=restorer)

    def served(prompts):
        outs = engine.generate(prompts, SamplingParams(max_tokens=MAX))
        for prompt, out in zip(prompts, outs):
            assert out.token_ids == hf_greedy(smollm2, prompt, MAX), tok.decode(prompt[-40:])
        return outs

    turn1 = [{"role": "user", "content": DECLARATION + "\n\nWhich rights does this passage name?"}]
    a1 = tok.chat(turn1)
    answer = served([a1])[0]
    served([tok.chat([{"role": "user", "content": GETTYSBURG + "\n\nWhat does the speaker dedicate?"}])])
    served([tok.chat([{"role": "user", "content": KITCHEN + "\n\nWhat do we cook on Tuesday?"}])])
    engine.pool.flush()                                    # the finished histories are in the pool
    a2 = tok.chat(turn1 + [{"role": "assistant", "content": tok.decode(answer.token_ids)},
                           {"role": "user", "content": "Who wrote it, and when?"}])
    assert a2[:len(a1)] == a1                              # the second turn extends the first
    back = served([a2])[0]
    assert engine.stats.requests_by_hit["pool"] == 1 and back.cached_tokens >= len(a1) // 32 * 32
    assert engine.stats.requests_by_hit["resident"] >= 2   # the later users share the system prompt's block
    engine.close()
