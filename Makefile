# Every target creates .venv on first use and installs what it needs.
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
# The CPU build of torch where there is no GPU (it installs from a local wheel and is small);
# the default (CUDA) build where nvidia-smi finds a GPU.
TORCH  := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo torch || echo torch==2.13.0)
# Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors.
KERNEL_ENV := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 || echo TRITON_INTERPRET=1)

.PHONY: demo test bench evaluate gpu-check clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[test]"
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

# The GPU layer: CUDA tests and kernel benchmarks (skipped, with a reason, where no GPU is present).
gpu-check: $(VENV)/.installed
	$(PY) -m pytest -q -m gpu tests bench/test_kernels_bench.py \
		--benchmark-json=bench/results/gpu_kernels.json

clean:
	rm -rf $(VENV) build *.egg-info
