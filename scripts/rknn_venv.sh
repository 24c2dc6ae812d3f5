#!/usr/bin/env bash
# Create .venv-rknn: rknn-toolkit2 (the x86 RKNN compiler + simulator) in its own environment.
#
#   scripts/rknn_venv.sh [VENV_DIR]        (default: .venv-rknn next to this repo's Makefile)
#
# Why a separate environment: rknn-toolkit2 2.5.0 pins numpy<=1.26.4, onnx<=1.18, protobuf<=4.25.4 and torch<=2.4,
# which clash with the main .venv. The main environment never imports rknn; models/rknn/worker.py runs here.
# rknn-toolkit2 is installed --no-deps (its torch<=2.4 pin would pull a multi-GB download); torch 2.13 CPU from the
# local wheel cache works with it. Idempotent: a stamp file records the pins; a second run with the same pins is a no-op.
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
VENV="${1:-$HERE/.venv-rknn}"
PY="${PY:-python3}"

RKNN_VERSION="${RKNN_VERSION:-2.5.0}"
# The toolkit's real run-time requirements, at versions that work with numpy 1.26 (found by installing and importing).
PINS=(
  "numpy==1.26.4"
  "onnx==1.18.0"
  "protobuf==4.25.4"
  "onnxruntime==1.20.1"
  "setuptools<70"
  "scipy==1.13.1"
  "psutil>=5.9"
  "ruamel.yaml>=0.17.21"
  "tqdm>=4.64.1"
  "fast-histogram>=0.11"
  "opencv-python-headless==4.10.0.84"
)
TORCH_DEPS=("filelock" "typing-extensions>=4.10.0" "sympy>=1.13.3" "networkx>=2.5.1" "jinja2" "fsspec>=0.8.5")
STAMP="$VENV/.rknn-installed"
WANT="rknn-toolkit2==$RKNN_VERSION torch==2.13.0 ${PINS[*]}"

if [[ -f "$STAMP" ]] && [[ "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import rknn.api" 2>/dev/null; then
  echo "rknn venv up to date: $VENV"
  exit 0
fi

start=$(date +%s)
test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch comes from the local wheel cache (pip's find-links); the CPU index keeps CUDA packages out if it is not there.
"$VENV/bin/python" -m pip install -q "${PINS[@]}" "${TORCH_DEPS[@]}"
# torch 2.13 asks for setuptools>=77 while the toolkit needs setuptools<70 (pkg_resources): torch goes in --no-deps,
# its other requirements are listed in TORCH_DEPS.
"$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0"
"$VENV/bin/python" -m pip install -q --no-deps "rknn-toolkit2==$RKNN_VERSION"
# Import check: fail here, not in the middle of a compile.
"$VENV/bin/python" -c "from rknn.api import RKNN; import rknn, onnx, numpy; print('rknn-toolkit2', '$RKNN_VERSION', 'numpy', numpy.__version__, 'onnx', onnx.__version__)"
echo "$WANT" > "$STAMP"
echo "rknn venv ready in $(( $(date +%s) - start )) s: $VENV"
