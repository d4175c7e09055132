# The two commands a newcomer types: `make test` (sets everything up, then runs the tests)
# and `make demo` (train three variants, evaluate, write the report; ~10 min on 2 cores).
PYTHON ?= python3.11
VENV   := .venv
PY     := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1

.PHONY: setup test test-slow demo study bench bench-core bench-train bench-peer bench-study bench-learning gpu-check clean

# Re-created whenever pyproject.toml changes, so a fresh clone needs no manual install step.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

setup: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15

# The demo study (conf/experiment/demo.yaml) into outputs/studies/demo; resumes what is done
# (rm -rf outputs/studies/demo to start over). Ends with `report: <path>/report.html`.
demo: $(VENV)/.installed
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m experiments.run study=demo

# Any study: make study STUDY=replay_length [SCALE=full] [SEEDS=[0,1,2]]
STUDY ?= demo
SCALE ?= demo
SEEDS ?=
study: $(VENV)/.installed
	WANDB_MODE=$${WANDB_MODE:-offline} $(PY) -m experiments.run study=$(STUDY) scale=$(SCALE) $(if $(SEEDS),'seeds=$(SEEDS)')

test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed
	$(PY) benchmarks/inference.py

bench-core: $(VENV)/.installed
	$(PY) benchmarks/core.py

bench-train: $(VENV)/.installed
	$(PY) benchmarks/train.py

# Training step of dense/swa/yoco/ced against a plain GPT of the same size: the short-context
# table (8x512, 2x2048; minutes) and the long-context one (B = 1, T = 8k-32k, step and prefill,
# peak memory; about 15 min at 8k on 2 CPU cores, far longer at 32k). One table: make bench-peer PEER_ARGS="--tables short"
PEER_ARGS ?=
bench-peer: $(VENV)/.installed
	$(PY) benchmarks/peer.py $(PEER_ARGS)

# The studies' own shapes (d_model 64, one thread, fp32; composed as experiment=depth / real_text
# compose them): ced, dense and swa's training step and eval forward, interleaved, ratios to
# dense, and a profile of ced's step at L_d = 20 (about 10 minutes) -> benchmarks/results/study.*
STUDY_BENCH_ARGS ?=
bench-study: $(VENV)/.installed
	$(PY) benchmarks/study.py $(STUDY_BENCH_ARGS)

# Learning probe: a plain GPT (learned or rotary positions) and the ced variants on the same
# synthetic rows; validation exact match against step -> benchmarks/results/learning.*
bench-learning: $(VENV)/.installed
	$(PY) benchmarks/learning.py

# On a CUDA machine: exactness of engine vs forward on the device, train-step and prefill
# timings per variant -> benchmarks/results/gpu_check.json (says so and checks nothing on CPU).
# On a machine whose own python has a CUDA torch (no venv to build, no network):
#   make gpu-check GPU_PY=python3 GPU_ARGS="--out /tmp/gpu"
GPU_PY ?= $(PY)
GPU_ARGS ?=
gpu-check: $(if $(filter $(PY),$(GPU_PY)),$(VENV)/.installed)
	$(GPU_PY) benchmarks/gpu_check.py $(GPU_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache
