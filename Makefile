# `make demo` and `make test` each create .venv with the pinned install when it is missing.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test fixtures clean

$(STAMP): setup.cfg pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch/torchvision are pinned in setup.cfg, in the same resolve as lmms-eval, so they cannot drift.
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

fixtures: $(STAMP)
	$(VENV)/bin/resadapt-eval fixtures --out fixtures

demo: $(STAMP)
	$(VENV)/bin/resadapt-eval demo --out demo_out

test: $(STAMP)
	$(PY) -m pytest -q tests

clean:
	rm -rf fixtures demo_out
