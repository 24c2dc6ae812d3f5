# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN ?= $(CURDIR)/run
# extra demo flags, e.g. make demo DEMO_ARGS="--resolution 512x512 --stop"
DEMO_ARGS ?=

.PHONY: demo test venv clean bench rknn-venv chromium

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

# Debian's Chromium drives the web page's test (Playwright with executable_path). Installed when missing; that needs
# root (CI runs as root): without it `make test` stops here rather than skipping the page test.
CHROMIUM := /usr/bin/chromium

$(CHROMIUM):
	@if [ "$$(id -u)" != 0 ]; then echo "make test needs $(CHROMIUM): run 'apt-get install -y chromium' as root" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium

chromium: $(CHROMIUM)

test: $(STAMP) $(RKNN_STAMP) $(CHROMIUM)
	$(BIN)/python -m pytest -q tests

clean:
	rm -rf $(VENV) .venv-rknn run build *.egg-info
