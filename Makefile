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

.PHONY: opinfo zoo demo test docs bench chain peers evaluate evaluate-quick gpu-check clean

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

# The documentation site (mkdocs.yml, docs/), built strictly into site/: a broken link, a missing anchor or a
# docstring mkdocstrings cannot read fails the build.
$(VENV)/.docs-installed: $(VENV)/.installed
	$(PY) -m pip install -q --disable-pip-version-check -e ".[docs]"
	touch $@

docs: $(VENV)/.docs-installed
	$(PY) -m mkdocs build --strict --site-dir site

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

# Equal-memory comparison against checkpointing, selective checkpointing and torch.compile's activation memory
# budget on bench/peer_models.py's GPT and ResNet: bench/results/peers.md (18 to 24 minutes on 2 cores).
peers: $(VENV)/.installed
	$(PY) -m bench.peers

# PyTorch's OpInfo database under a Budget, bitwise against plain PyTorch: bench/results/opinfo.md (a fast subset
# runs in make test: tests/test_opinfo.py).
opinfo: $(VENV)/.installed
	$(PY) -m bench.opinfo --samples 2 --out bench/results/opinfo.md

# Models of timm and transformers built from configs, trained under Budgets at 1.0, 0.5 and 0.3 of their peak,
# bitwise against plain PyTorch: bench/results/zoo.md (the evaluation environment: timm needs torchvision).
zoo: $(EVAL_VENV)/.installed
	$(EVAL_PY) -m bench.zoo --out bench/results/zoo.md

# The paper's evaluation: nine models, every policy and ablation, dry runs on meta (about 15 minutes on 2 cores).
evaluate: $(EVAL_VENV)/.installed
	$(EVAL_PY) -m coop_arena evaluate --jobs 2 --out bench/results/evaluation

evaluate-quick: $(EVAL_VENV)/.installed
	$(EVAL_PY) -m coop_arena evaluate --quick --jobs 2 --out bench/results/evaluation-quick

# The GPU check (bench/gpu_check.py: the @pytest.mark.gpu layer, kernel bandwidth, GPT-2 and ResNet-50 under
# Budgets; under 8 minutes; every part skipped with a reason where there is no GPU). It installs nothing where
# torch, triton and numpy are already installed: it runs .venv's Python if that imports them (with CUDA, where
# nvidia-smi sees a GPU), else the first of $(PYTHON), python3, python that does, as it is (gpu_check.py's
# children import this checkout; no venv, whose --system-site-packages would hide a torch installed in another
# venv, and no build, which needs setuptools and wheel). Only where no Python has torch does it fall back to
# .venv/.installed (a download).
HAS_GPU    := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1 || echo 0)
GPU_VENV   := .venv-gpu
# where gpu_check.json, gpu_check.md and gpu_kernels.json go: `make gpu-check GPU_OUT=DIR`
GPU_OUT    ?= bench/results
GPU_PROBE  := import sys, numpy, torch, triton; sys.exit(0 if torch.cuda.is_available() or not $(HAS_GPU) else 1)
gpu-check:
	@py=""; \
	if [ -x $(PY) ] && $(PY) -c "$(GPU_PROBE)" >/dev/null 2>&1; then py=$(PY); \
	else for base in $(PYTHON) python3 python; do \
		command -v $$base >/dev/null 2>&1 && $$base -c "$(GPU_PROBE)" >/dev/null 2>&1 || continue; \
		py=$$(command -v $$base); break; \
	done; fi; \
	if [ -z "$$py" ]; then PIP_RETRIES=0 PIP_TIMEOUT=10 $(MAKE) $(VENV)/.installed && py=$(PY) || { \
		echo "gpu-check: no Python here imports torch, triton and numpy (with CUDA), and making $(VENV) failed" \
		     "(no network?): install them, or run with PYTHON=a-python-that-has-them"; exit 1; }; fi; \
	echo "gpu-check: $$py (torch $$($$py -c 'import torch; print(torch.__version__)'))"; \
	$$py bench/gpu_check.py --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(EVAL_VENV) $(GPU_VENV) build *.egg-info
