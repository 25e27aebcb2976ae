"""The advisor: its numbers are the hand-computed ones, its shapes count the real parameters, its rule picks what
pays, every preset gets a recommendation in the table, and bad input is one line with exit code 2."""

import json

import pytest

from kvflow.advisor import advise, load_shape, table
from kvflow.advisor.advise import PAYS, recommend
from kvflow.advisor.memory import weights_per_device
from kvflow.advisor.shapes import table_models
from kvflow.cli.main import main
from kvflow.errors import ConfigError, ModelError
from kvflow.model.presets import PRESETS


def test_llama_8b_on_80_gib_at_tp_2_matches_the_hand_computation():
    # Llama-3.1-8B: L=32, h=4096, I=14336, 32 q / 8 kv heads, head_dim 128, V=128256, untied; bf16, TP 2.
    layer = 2 * 4096 * 2048 + 2 * 4096 * 512 + 3 * 4096 * 14336 // 2 + 2 * 4096     # q+o, k+v, MLP, 2 norms
    assert layer == 109_060_096
    weights = (32 * layer + 2 * 128256 * 4096 // 2 + 4096) * 2                       # + embedding + LM head + norm
    assert weights == 8_030_527_488
    per_token = 2 * max(2 * 4096 + 3 * 14336 // 2, 2 * 4096 + 2 * (16 + 4) * 128)    # MLP wins: 29,696 x 2 B
    assert per_token == 59_392
    reserve, small, decode = 2048 * per_token, 512 * per_token, 256 * per_token
    kv_bytes = 72 * 2**30 - weights - reserve                                        # 80 GiB x 0.9
    kv_per_token = 2 * 32 * 4 * 128 * 2                                              # 4 kv heads per device

    a = advise("llama-3.1-8b", 80, tp=2, chunk=2048)
    assert (a.weights, a.reserve, a.reserve_small, a.reserve_decode) == (weights, reserve, small, decode)
    assert (a.kv_bytes, a.kv_bytes_per_token) == (kv_bytes, kv_per_token) == (69_157_249_024, 65_536)
    assert a.kv_tokens == kv_bytes // kv_per_token == 1_055_255
    assert a.elastic_tokens == (reserve - decode) // kv_per_token == 1_624
    assert a.small_chunk_tokens == (reserve - small) // kv_per_token == 1_392
    assert a.small_chunk == 512 and a.recommendation == "keep chunk 2048"           # 0.2% of KV: neither pays


def test_the_same_model_by_its_real_id_gives_the_same_advice():
    assert advise("meta-llama/Llama-3.1-8B", 80, tp=2) == advise("llama-3.1-8b", 80, tp=2)


@pytest.mark.parametrize("name", list(PRESETS))
def test_shapes_count_the_parameters_transformers_builds(name):
    import torch
    from transformers import AutoModelForCausalLM

    from kvflow.model.presets import build_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(PRESETS[name]))
    shape = load_shape(name)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert weights_per_device(shape, 1, 1, 2) == 2 * shape.params


def test_tp_and_pp_split_weights_and_kv_but_not_the_residual():
    one, two = advise("llama-3.1-8b", 80, tp=1), advise("llama-3.1-8b", 80, tp=2)
    assert two.weights < one.weights and two.kv_bytes_per_token * 2 == one.kv_bytes_per_token
    assert one.reserve / 2 < two.reserve < one.reserve              # the 2h residual stays on every device
    assert advise("llama-3.1-8b", 80, pp=2).kv_bytes_per_token * 2 == one.kv_bytes_per_token


def test_kv_heads_are_replicated_beyond_their_count():
    a4, a8 = advise("llama-3.1-8b", 80, tp=4), advise("llama-3.1-8b", 80, tp=8)   # 8 kv heads: TP 8 holds one
    assert a4.kv_bytes_per_token == 2 * a8.kv_bytes_per_token
    assert advise("tiny", 24, tp=8).kv_bytes_per_token == advise("tiny", 24, tp=2).kv_bytes_per_token


def test_the_rule_shrinks_the_chunk_first_and_lends_what_still_pays():
    kv = 1000
    assert recommend(kv, 10, 5, 1, 2048, 512)[0] == "keep chunk 2048"
    assert recommend(kv, 200, 20, 10, 2048, 512)[0] == "chunk 512"
    assert recommend(kv, 400, 200, 10, 2048, 512)[0] == "chunk 512 + --elastic-reserve"
    assert recommend(kv, 200, 200, 10, 512, 512)[0] == "--elastic-reserve"         # no smaller chunk to take
    assert recommend(kv, int(PAYS * kv) + 11, 11, 11, 2048, 512)[0] == "chunk 512"   # exactly the threshold pays


def test_little_memory_and_a_long_chunk_is_where_elasticity_pays():
    a = advise("llama-3.1-8b", 18, tp=1, chunk=8192, small_chunk=8192)
    assert a.recommendation == "--elastic-reserve" and a.elastic_tokens > 0


def test_the_table_recommends_for_every_preset_at_every_tp_and_gpu_memory():
    cells = table(table_models(), [24, 80, 141], [1, 2, 4, 8], [2048])
    assert {c.model for c in cells} >= set(PRESETS)
    assert len(cells) == len(table_models()) * 3 * 4
    for c in cells:
        assert (c.advice is not None and c.advice.recommendation) or c.problem, c
    assert any(c.problem.startswith("TP 4 does not divide qwen2.5-0.5b") for c in cells)


def test_advise_table_command_prints_a_row_per_configuration(capsys):
    assert main(["advise", "--table", "--chunk", "2048", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == len(table_models()) * 3 * 4
    assert all(r["advice"] or r["problem"] for r in rows)


def test_advise_command_prints_the_formula_and_one_recommendation(capsys):
    assert main(["advise", "--model", "llama-3.1-8b", "--gpu-mem", "24", "--tp", "1", "--chunk", "8192"]) == 0
    out = capsys.readouterr().out
    assert "reserve = k x C x b x max(" in out and "102,400 B per token" in out
    assert sum(line.startswith("recommendation: ") for line in out.splitlines()) == 1


@pytest.mark.parametrize("args, needle", [
    (["--model", "nope", "--gpu-mem", "24"], "unknown model 'nope'"),
    (["--model", "qwen2.5-0.5b", "--gpu-mem", "24", "--tp", "4"], "TP 4 does not divide"),
    (["--model", "tiny", "--gpu-mem", "24", "--tp", "3"], "TP 3 does not divide"),
    (["--model", "llama-3.1-70b", "--gpu-mem", "80"], "does not fit 80 GiB"),
    (["--model", "llama-3.1-8b", "--gpu-mem", "24", "--max-model-len", "131072"], "fewer than one --max-model-len"),
    (["--model", "tiny", "--gpu-mem", "-1"], "--gpu-mem must be > 0"),
    (["--model", "tiny", "--gpu-mem", "abc"], "--gpu-mem"),
    (["--model", "tiny", "--gpu-mem", "24", "--chunk", "0"], "--chunk must be >= 1"),
    (["--model", "tiny", "--gpu-mem", "24", "--kv-dtype", "int3"], "--kv-dtype 'int3'"),
    (["--model", "tiny", "--gpu-mem", "24", "--pp", "9"], "PP 9 exceeds"),
    (["--model", "./no/such/dir", "--gpu-mem", "24"], "no such checkpoint directory"),
    (["--gpu-mem", "24"], "needs --model and --gpu-mem"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, needle):
    assert main(["advise", *args]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and needle in lines[0], err


def test_the_python_function_raises_the_same_one_line_errors():
    with pytest.raises(ModelError):
        advise("nope", 24)
    with pytest.raises(ConfigError, match="does not divide"):
        advise("qwen2.5-0.5b", 24, tp=8)


def test_a_checkpoint_directory_is_read_from_its_config(tmp_path):
    cfg = dict(PRESETS["llama-3.2-1b"].config, model_type="llama")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_shape(str(tmp_path)).params == load_shape("llama-3.2-1b").params
