"""advise(): for one model, GPU memory and TP/PP layout — weights, activation reserve and KV capacity per device,
what the elastic reserve would lend vs what a smaller token budget (chunk) would free, and which one pays.

    capacity = GPU memory x utilization - weights - reserve(C)               per device, in bytes -> tokens
    elastic lends   reserve(C) - reserve(S)         only while decodes alone run (S: a decode step of max-seqs)
    smaller chunk   reserve(C) - reserve(C_small)   always; the seed found TTFT almost insensitive to the chunk

The rule (``recommend``): a change pays when it adds at least ``PAYS`` of the KV capacity. Shrinking the chunk
comes first (permanent, no take-back, ~1% TTFT per the seed); the elastic reserve is then worth it only if what
is left of the reserve still pays — the seed's map: small models / little free memory, long prompts, no TP.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvflow.advisor.memory import FORMULA, activation_reserve, check_parallel, kv_bytes_per_token, weights_per_device
from kvflow.advisor.shapes import load_shape
from kvflow.config import check
from kvflow.errors import ConfigError, KVFlowError
from kvflow.model.dtypes import sized
from kvflow.model.shape import ModelShape

GiB = 2**30
PAYS = 0.05        # 5% more KV: below it the extra concurrency is lost in scheduling noise, not worth a take-back


@dataclass(frozen=True, slots=True)
class Advice:
    model: str
    gpu_mem_gib: float
    tp: int
    pp: int
    chunk: int
    small_chunk: int
    weights: int                 # bytes per device (the fullest stage)
    reserve: int                 # activation reserve per device at ``chunk``
    reserve_small: int           # ... at ``small_chunk``
    reserve_decode: int          # ... of a decode-only step (max_seqs tokens)
    kv_bytes: int                # KV memory per device
    kv_bytes_per_token: int      # per device
    kv_tokens: int               # KV capacity of the engine, tokens
    elastic_tokens: int          # tokens the elastic reserve lends while only decodes run
    small_chunk_tokens: int      # tokens a smaller chunk frees for good
    factor: float                # k of the reserve formula (1: uncalibrated)
    recommendation: str
    reason: str

    def as_dict(self) -> dict:
        return asdict(self)


def recommend(kv_bytes: int, reserve: int, reserve_small: int, reserve_decode: int, chunk: int, small: int
              ) -> tuple[str, str]:
    share = lambda b: max(0, b) / kv_bytes                                            # noqa: E731
    elastic, shrink, rest = share(reserve - reserve_decode), share(reserve - reserve_small), share(
        reserve_small - reserve_decode)
    if small < chunk and shrink >= PAYS:
        if rest >= PAYS:
            return (f"chunk {small} + --elastic-reserve",
                    f"a smaller chunk frees {shrink:.0%} of KV for good; the rest of the reserve still lends "
                    f"{rest:.0%} while only decodes run")
        return (f"chunk {small}", f"frees {shrink:.0%} of KV for good (TTFT ~unchanged per the seed); elastic would "
                                  f"lend {elastic:.0%}, only while decodes run and with a take-back per long prompt")
    if elastic >= PAYS:
        return ("--elastic-reserve", f"lends {elastic:.0%} of KV while only decodes run; a smaller chunk frees only "
                                     f"{shrink:.0%}")
    return (f"keep chunk {chunk}", f"the reserve is {share(reserve):.1%} of KV: neither elasticity nor a smaller "
                                   f"chunk adds {PAYS:.0%}")


def default_small_chunk(chunk: int) -> int:
    """A quarter of the chunk, at least 256 tokens (never above the chunk)."""
    return min(chunk, max(256, chunk // 4))


def advise(model: str | ModelShape, gpu_mem_gib: float, tp: int = 1, pp: int = 1, chunk: int = 2048, *,
           dtype: str = "bf16", kv_dtype: str = "bf16", max_model_len: int = 0, small_chunk: int = 0,
           max_seqs: int = 256, utilization: float = 0.9, factor: float = 1.0) -> Advice:
    """One configuration. Raises ConfigError/ModelError (one line) for bad input or a model that does not fit."""
    shape = model if isinstance(model, ModelShape) else load_shape(model)
    check(gpu_mem_gib > 0, f"--gpu-mem must be > 0 GiB, got {gpu_mem_gib}")
    check(chunk >= 1, f"--chunk must be >= 1 token, got {chunk}")
    check(max_model_len >= 0, f"--max-model-len must be >= 0, got {max_model_len}")
    check(max_seqs >= 1, f"--max-seqs must be >= 1, got {max_seqs}")
    check(0 < utilization <= 1, f"--utilization must be in (0, 1], got {utilization}")
    check(factor > 0, f"the reserve factor must be > 0, got {factor}")
    small = small_chunk or default_small_chunk(chunk)
    check(1 <= small <= chunk, f"--small-chunk must be in [1, --chunk {chunk}], got {small}")
    check_parallel(shape, tp, pp)
    b = sized(dtype, "--dtype")
    sized(kv_dtype, "--kv-dtype")
    usable = int(gpu_mem_gib * GiB * utilization)
    weights = weights_per_device(shape, tp, pp, b)
    res = lambda n: activation_reserve(shape, n, tp, dtype, factor)                        # noqa: E731
    reserve, reserve_small, reserve_decode = res(chunk), res(small), res(min(max_seqs, chunk))
    kv_bytes = usable - weights - reserve
    where = f"{shape.name} at TP {tp}" + (f" x PP {pp}" if pp > 1 else "")
    if kv_bytes <= 0:
        raise ConfigError(f"{where} does not fit {gpu_mem_gib:g} GiB: weights {weights / GiB:.1f} GiB + reserve "
                          f"{reserve / GiB:.2f} GiB > {usable / GiB:.1f} GiB usable per device; raise TP/PP")
    per_token = kv_bytes_per_token(shape, tp, pp, kv_dtype)
    kv_tokens = kv_bytes // per_token
    if max_model_len and kv_tokens < max_model_len:
        raise ConfigError(f"{where} on {gpu_mem_gib:g} GiB holds {kv_tokens:,} KV tokens, fewer than one "
                          f"--max-model-len context of {max_model_len:,}; raise TP/PP or lower it")
    rec, reason = recommend(kv_bytes, reserve, reserve_small, reserve_decode, chunk, small)
    return Advice(shape.name, gpu_mem_gib, tp, pp, chunk, small, weights, reserve, reserve_small, reserve_decode,
                  kv_bytes, per_token, kv_tokens, (reserve - reserve_decode) // per_token,
                  (reserve - reserve_small) // per_token, factor, rec, reason)


def formula(shape: ModelShape, tp: int, dtype: str, factor: float) -> str:
    """The reserve formula with this model's numbers filled in (bytes per token of the token budget)."""
    b = sized(dtype, "--dtype")
    return (f"reserve = {FORMULA}; {shape.name}: h={shape.hidden}, I={shape.intermediate}, heads={shape.heads}, "
            f"kv_heads={shape.kv_heads}, head_dim={shape.head_dim}, b={b}, TP={tp}, k={factor:.2f} -> "
            f"{factor * shape.activation_bytes_per_token(dtype, tp):,.0f} B per token")


@dataclass(frozen=True, slots=True)
class Cell:
    """One row of the table: the advice, or why that configuration cannot run."""
    model: str
    gpu_mem_gib: float
    tp: int
    chunk: int
    advice: Advice | None
    problem: str = ""


def table(models: list[str], gpu_mems: list[float], tps: list[int], chunks: list[int], **kw) -> list[Cell]:
    rows = []
    for name in models:
        shape = load_shape(name)
        for mem in gpu_mems:
            for tp in tps:
                for chunk in chunks:
                    try:
                        rows.append(Cell(shape.name, mem, tp, chunk, advise(shape, mem, tp, chunk=chunk, **kw)))
                    except KVFlowError as err:
                        rows.append(Cell(shape.name, mem, tp, chunk, None, str(err)))
    return rows
