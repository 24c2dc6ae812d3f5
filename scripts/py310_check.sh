#!/usr/bin/env bash
# make py310-check: the board install on Python 3.10 (Ubuntu 22.04, the most common RK3588 image), where
# stages/config.py reads TOML through tomli. A fresh .venv-py310 gets '.[board]' plus pytest and hypothesis (no torch),
# then the tests that parse configs and prompts run there from the installed package.
#
#   PY310=/path/to/python3.10 scripts/py310_check.sh
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY310="${PY310:-python3.10}"
VENV="${PY310_VENV:-$HERE/.venv-py310}"
TESTS=(tests/test_stage_base.py tests/test_prompt_spec.py tests/test_orchestrator_cli.py tests/test_jobs.py
       tests/test_protocol_codec.py tests/test_board_install.py)

if ! "$PY310" -c 'import sys; assert sys.version_info[:2] == (3, 10)' 2>/dev/null; then
  echo "py310-check: no Python 3.10 interpreter at '$PY310' (set PY310=...)" >&2
  exit 1
fi
rm -rf "$VENV"
"$PY310" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
SRC="$(mktemp -d /tmp/anima-py310-src.XXXXXX)"
trap 'rm -rf "$SRC"' EXIT
git -C "$HERE" ls-files -z --cached --others --exclude-standard | (cd "$HERE" && xargs -0 cp --parents -t "$SRC" 2>/dev/null || true)
"$VENV/bin/python" -m pip install -q "$SRC[board]" "pytest>=8" "hypothesis>=6" 2>&1 | grep -v '^WARNING: Location' || true
(cd /tmp && env -u PYTHONPATH "$VENV/bin/python" - <<'PY'
import importlib.util, sys
assert sys.version_info[:2] == (3, 10), sys.version
assert importlib.util.find_spec("tomllib") is None and importlib.util.find_spec("tomli") is not None
for m in ("torch", "transformers", "onnx"):
    assert importlib.util.find_spec(m) is None, f"{m} importable in the board venv"
import stages.config
assert "site-packages" in stages.config.__file__, stages.config.__file__
print(f"python {sys.version.split()[0]}: tomli in place of tomllib, no torch; stages.config from {stages.config.__file__}")
PY
)
# From the installed package: only the tests (and the files they read) are copied, so no source is importable.
T="$(mktemp -d /tmp/anima-py310-tests.XXXXXX)"
trap 'rm -rf "$SRC" "$T"' EXIT
cp -r "$HERE/tests" "$HERE/pyproject.toml" "$T/" && mkdir "$T/scripts" && cp "$HERE/scripts/rknn_venv.sh" "$T/scripts/"
# Left out here: the two tests that need the host's tools (the rknn compiler fixture, the synthetic bundle writer) and
# the one of the labelled RKNNLite stand-in, which the installed package does not ship (tests/test_wheel_install.py).
cd "$T" && env -u PYTHONPATH "$VENV/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" -m "not slow" \
  -k "not rknn_backend_checks and not onnx_encoder_stage_runs and not lite_pin_equals_the_compiler_release"
