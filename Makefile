# Two commands on a fresh machine (python3 and make are all it needs):
#   make demo    set up, then train the small GPT on 2 CPU ranks, checkpoint, resume
#   make check   set up, then ruff, mypy --strict and pytest
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup demo demo-nodes check test lint docs check-hatch check-gpu gpu-wheels bench bench-scaling bench-compare soak fuzz clean

$(STAMP): constraints.txt packages/*/pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt torch numpy safetensors hatchling editables hatch ruff mypy pytest pytest-benchmark hypothesis matplotlib \
		mkdocs mkdocs-material mkdocstrings mkdocstrings-python
	$(BIN)/pip install -q -c constraints.txt --no-deps torchao accelerate huggingface-hub psutil \
		transformers tokenizers regex tqdm
	$(BIN)/pip install -q -c constraints.txt --no-build-isolation --no-deps \
		-e packages/core -e packages/tp_adapter -e packages/legacy_fsdp_compat -e packages/tools
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(BIN)/python demo/run_demo.py

# The demo as two torchrun "nodes" of 2 ranks on this machine (c10d rendezvous, HSDP).
demo-nodes: $(STAMP)
	$(BIN)/python demo/run_demo.py --nodes 2

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q

check: lint test

# The documentation site (mkdocs.yml) in site/: strict, so a broken link, anchor, include or
# API reference fails (CI runs it after `check`).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# The soak test (minutes): 300 demo steps with 5 ranks SIGKILLed and restarted by torchrun,
# bit-identical to an uninterrupted run; prints the steps lost per kill.
soak: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -q -s -m slow

# The readers' fuzzing at length (seconds; soak runs it too): 500 damaged files of each kind.
fuzz: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/core/test_state_dict_fuzz.py -q -s -m slow

# The hatch workflow from nothing: four wheels, and CPU torch in a fresh `hatch test` environment
# (about a minute; CI runs it after `check`).
check-hatch: $(STAMP)
	$(BIN)/python scripts/check_hatch.py

# Every GPU test and benchmark, and one table of what they found (scripts/check_gpu.py; about
# 20 minutes on one H100). CHUNKS=parity,tools runs some (`--list` names them). Needs CUDA, and
# no venv: on a GPU machine its python has torch, and shardkit comes from .whl/ (gpu-wheels).
check-gpu:
	$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PY)) scripts/check_gpu.py $(if $(CHUNKS),--chunks $(CHUNKS))

# The four packages as wheels in .whl/, for a machine without hatchling or network (check-gpu).
gpu-wheels: $(STAMP)
	rm -rf .whl .gpu-site
	$(BIN)/pip wheel -q --no-deps --no-build-isolation -w .whl \
		packages/core packages/tp_adapter packages/legacy_fsdp_compat packages/tools

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest benchmarks -q -s --benchmark-autosave \
		--ignore=benchmarks/bench_scaling.py

# How cost grows: one table by model size (8M, 35M, 134M) and world size (1, 2, 4), written to
# benchmarks/.results/scaling.md (about half an hour here; SCALING_SIZES, SCALING_WORLDS and
# SCALING_ROUNDS pick a smaller run).
bench-scaling: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest benchmarks/bench_scaling.py -q -s --benchmark-autosave

# Fails when a ratio against the peer worsened by more than 10% since the previous saved run.
bench-compare: $(STAMP)
	$(BIN)/python scripts/bench_compare.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache site .whl .gpu-site .gpu-check
