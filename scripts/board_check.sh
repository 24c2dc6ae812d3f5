#!/usr/bin/env bash
# make board-check: the board's install on this machine. A fresh .venv-board gets `pip install '.[board]'` (on x86 the
# rknn-toolkit-lite2 wheel is skipped by its marker); torch, transformers and onnx must not be importable there; the
# host venv (.venv) writes the tiny models, the DiT pack, the encoder pack and the VAE's ONNX files; then the whole
# tiny job runs through supervisord from .venv-board with encoder and VAE on ONNX Runtime (scripts/board_check.py).
# Last line: `board-check ok torch=absent job_s=… venv_mb=…`.
#
#   scripts/board_check.sh            BOARD_VENV=/tmp/vb scripts/board_check.sh     BOARD_ASSETS=DIR (default .board-check)
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PY:-python3}"
VENV="${BOARD_VENV:-$HERE/.venv-board}"
HOST="${HOST_VENV:-$HERE/.venv}"
ASSETS="${BOARD_ASSETS:-$HERE/.board-check}"

start=$(date +%s)
rm -rf "$VENV"
"$PY" -m venv "$VENV"
quiet() { { grep -v '^WARNING: Location' || true; } }      # pip's note about this machine's local index
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
# Not editable: the stages must run the installed package, as on the board. Built from a copy of the tree so the
# build leaves nothing in it.
SRC="$(mktemp -d /tmp/anima-board-src.XXXXXX)"
trap 'rm -rf "$SRC"' EXIT
git -C "$HERE" ls-files -z --cached --others --exclude-standard | (cd "$HERE" && xargs -0 cp --parents -t "$SRC" 2>/dev/null || true)
"$VENV/bin/python" -m pip install -q "$SRC[board]" 2>&1 | quiet
echo "board venv ready in $(( $(date +%s) - start )) s: $VENV ($(du -sm "$VENV" | cut -f1) MB)"
for m in torch transformers onnx; do
  if "$VENV/bin/python" -c "import $m" 2>/dev/null; then echo "board-check: $m is importable in $VENV" >&2; exit 1; fi
done
"$HOST/bin/python" "$HERE/scripts/board_check.py" prepare --assets "$ASSETS"
cd /tmp
env -u PYTHONPATH "$VENV/bin/python" "$HERE/scripts/board_check.py" run --assets "$ASSETS" --venv "$VENV"
