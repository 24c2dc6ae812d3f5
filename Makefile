# Everything a fresh machine needs: `make demo` and `make test` create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
RUN ?= $(CURDIR)/run
# extra demo flags, e.g. make demo DEMO_ARGS="--resolution 512x512 --stop"; PORT: the HTTP front's (make demo PORT=8190)
DEMO_ARGS ?=
PORT ?=

.PHONY: demo test test-setup venv clean bench rknn-venv chromium board-check py310-check arm64-check

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m orchestrator.terminal.demo --run $(RUN) $(if $(PORT),--port $(PORT)) $(DEMO_ARGS)

# rknn-toolkit2 (the x86 RKNN compiler + simulator) in its own environment; its pins clash with .venv.
RKNN_STAMP := .venv-rknn/.rknn-installed

$(RKNN_STAMP): scripts/rknn_venv.sh
	PY=$(PY) bash scripts/rknn_venv.sh

rknn-venv: $(RKNN_STAMP)

# Debian packages the tests use, installed when missing, in one apt-get call (dpkg takes one lock: two calls side by
# side under `make -j` would fail). That needs root (CI runs as root): without it `make test` stops here rather than
# skipping the tests that use them.
#   chromium         drives the web page's test (Playwright with executable_path)
#   systemd          its systemd-analyze checks the unit `orchestrator service install` writes (tests/test_service.py);
#                    systemd is not started
CHROMIUM := /usr/bin/chromium
SYSTEMD_ANALYZE := /usr/bin/systemd-analyze
DEBS := $(CHROMIUM) $(SYSTEMD_ANALYZE)

$(DEBS) &:
	@want=""; [ -x $(CHROMIUM) ] || want="$$want chromium"; [ -x $(SYSTEMD_ANALYZE) ] || want="$$want systemd"; \
	if [ -z "$$want" ]; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ]; then echo "make test needs$$want: run 'apt-get install -y$$want' as root" >&2; exit 1; fi; \
	DEBIAN_FRONTEND=noninteractive apt-get update -q && \
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$want

chromium: $(CHROMIUM)

# Two workers, whole modules each (a module's pipeline is started once); a short base folder of its own, because the
# unix sockets a test's run folder holds must stay under 100 characters and xdist adds a folder per worker.
TEST_WORKERS ?= 2

# The set-up's independent parts (.venv, .venv-rknn, the Debian packages) side by side (two venvs 2:05 -> 1:18 on 2
# cores); the test run itself is one recipe.
test-setup: $(STAMP) $(RKNN_STAMP) $(DEBS)

test:
	@$(MAKE) --no-print-directory -j3 test-setup
	@T=$$(mktemp -d /tmp/anima-pt.XXXXXX); \
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=30 --basetemp=$$T tests; rc=$$?; rm -rf $$T; exit $$rc

# The board's install on this machine: a fresh .venv-board (pip install '.[board]', no torch), the tiny job through
# supervisord from it with encoder and VAE on ONNX Runtime. Last line: board-check ok torch=absent job_s=… venv_mb=…
board-check: $(STAMP)
	PY=$(PY) bash scripts/board_check.sh

# The board install on Python 3.10 (Ubuntu 22.04's): .venv-py310 with '.[board]' + pytest, the config-parsing tests.
PY310 ?= $(firstword $(wildcard /root/.pyenv/versions/3.10.*/bin/python) python3.10)
py310-check:
	PY310=$(PY310) bash scripts/py310_check.sh

# Not in CI: a Debian arm64 root (debootstrap + qemu-user-static) where '.[board]' installs and rknnlite imports.
arm64-check:
	bash scripts/arm64_check.sh

clean:
	rm -rf $(VENV) .venv-rknn .venv-board .venv-py310 .board-check run build *.egg-info
