#!/usr/bin/env bash
# Which transformers releases run models/text/qwen3.py correctly? Installs each candidate into one scratch venv and
# runs tests/test_qwen3_reference.py (Qwen3 vs a float64 numpy forward with RoPE θ 1e6 written out; a release that
# ignores the `rope_parameters` argument falls back to θ 10,000 and fails). Not part of CI: it downloads releases.
#
#   scripts/transformers_floor.sh [VERSION...]        (default: 4.51.3 4.57.6 5.0.0 5.1.0)
#   VENV=/tmp/tf-floor scripts/transformers_floor.sh 5.0.0
#
# Prints one line per version: `transformers X: pass|fail (reason)`; the floor in pyproject.toml is the oldest pass.
set -uo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${VENV:-/tmp/anima-transformers-floor}"
PY="${PY:-python3}"
VERSIONS=("$@")
[[ ${#VERSIONS[@]} -gt 0 ]] || VERSIONS=(4.51.3 4.57.6 5.0.0 5.1.0)

test -x "$VENV/bin/python" || "$PY" -m venv "$VENV" || exit 1
"$VENV/bin/python" -m pip install -q "torch==2.13.0" numpy pytest safetensors || exit 1
for v in "${VERSIONS[@]}"; do
  if ! "$VENV/bin/python" -m pip install -q "transformers==$v" >"$VENV/install-$v.log" 2>&1; then
    echo "transformers $v: fail (does not install here: $(tail -1 "$VENV/install-$v.log"))"
    continue
  fi
  got=$("$VENV/bin/python" -c "import transformers; print(transformers.__version__)")
  if (cd "$HERE" && PYTHONPATH="$HERE" "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
        tests/test_qwen3_reference.py >"$VENV/test-$v.log" 2>&1); then
    echo "transformers $got: pass"
  else
    echo "transformers $got: fail ($(grep -E '^E ' "$VENV/test-$v.log" | head -2 | tr -s ' ' | tr '\n' ' '))"
  fi
done
