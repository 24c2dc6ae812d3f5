# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN ?= $(CURDIR)/run
# extra demo flags, e.g. make demo DEMO_ARGS="--resolution 512x512 --stop"
DEMO_ARGS ?=

.PHONY: demo test venv clean bench rknn-venv

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m orchestrator.demo --run $(RUN) $(DEMO_ARGS)

# rknn-toolkit2 (the x86 RKNN compiler + simulator) in its own environment; its pins clash with .venv.
RKNN_STAMP := .venv-rknn/.rknn-installed

$(RKNN_STAMP): scripts/rknn_venv.sh
	PY=$(PY) bash scripts/rknn_venv.sh

rknn-venv: $(RKNN_STAMP)

test: $(STAMP) $(RKNN_STAMP)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .venv-rknn run build *.egg-info
