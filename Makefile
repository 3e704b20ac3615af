# Every target creates .venv on first use and installs what it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch where there is no GPU (it installs from a local wheel and is small);
# the default (CUDA) build where nvidia-smi finds a GPU.
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.
KERNEL_ENV := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || echo TRITON_INTERPRET=1)

# The evaluation needs torchvision, which has no build for the CPU torch above: it gets its own environment
# with torch 2.14.1 and torchvision 0.29.1 (from PyPI: a CUDA build, which also runs on the CPU).
EVAL_VENV := .venv-eval
EVAL_PY   := $(EVAL_VENV)/bin/python

.PHONY: demo test bench chain evaluate evaluate-quick gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
	touch $@

$(EVAL_VENV)/.installed: pyproject.toml
	test -x $(EVAL_PY) || $(PYTHON) -m venv $(EVAL_VENV) || python3 -m venv $(EVAL_VENV)
	$(EVAL_PY) -m pip install -q --disable-pip-version-check torch==2.14.1 torchvision==0.29.1
	$(EVAL_PY) -m pip install -q --disable-pip-version-check -e ".[test,models]"
	touch $@

demo: $(VENV)/.installed
	$(PY) -m coop_arena demo

test: $(VENV)/.installed
	$(KERNEL_ENV) $(PY) -m pytest -q tests

bench: $(VENV)/.installed
	$(KERNEL_ENV) $(PY) -m pytest -q bench/test_search_latency.py --benchmark-only \
		--benchmark-json=bench/results/search_latency.json
	$(KERNEL_ENV) $(PY) -m pytest -q bench/test_step_time.py --benchmark-only \
		--benchmark-json=bench/results/step_time.json
	$(PY) bench/report.py step_time bench/results/step_time.json > bench/results/step_time.md
	$(KERNEL_ENV) $(PY) -m pytest -q bench/test_kernels_bench.py --benchmark-only

# The linear chain against its optimal checkpointing schedule: bench/results/chain.md (a few minutes).
chain: $(VENV)/.installed
	$(PY) -m bench.chain

# The paper's evaluation: nine models, every policy and ablation, dry runs on meta (about 30 minutes on 2 cores).
evaluate: $(EVAL_VENV)/.installed
	$(EVAL_PY) -m coop_arena evaluate --jobs 2 --out bench/results/evaluation

evaluate-quick: $(EVAL_VENV)/.installed
	$(EVAL_PY) -m coop_arena evaluate --quick --jobs 2 --out bench/results/evaluation-quick

# The GPU layer: CUDA tests and kernel benchmarks (skipped, with a reason, where no GPU is present).
gpu-check: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests bench/test_kernels_bench.py \
		--benchmark-json=bench/results/gpu_kernels.json

clean:
	rm -rf $(VENV) $(EVAL_VENV) build *.egg-info
