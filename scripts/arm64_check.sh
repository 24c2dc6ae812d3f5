#!/usr/bin/env bash
# make arm64-check (not in CI; root, network to Debian and PyPI, minutes of emulation): a Debian bookworm arm64 root
# made by debootstrap, run through qemu-user-static (binfmt_misc), where `pip install '.[board]'` must install (with
# rknn-toolkit-lite2, which only exists for aarch64) and `from rknnlite.api import RKNNLite` must import. Then one
# compiled tiny branch goes through RKNNLite.load_rknn and init_runtime without an NPU (no /dev/dri, no librknnrt
# driver): what they return and print is reported as it is.
#
#   scripts/arm64_check.sh                 ARM64_ROOT=/var/tmp/anima-arm64 (kept between runs; KEEP=0 removes it)
set -euo pipefail
HERE="$(cd "$(dirname "$0")/.." && pwd)"
ROOTFS="${ARM64_ROOT:-/var/tmp/anima-arm64-root}"
SUITE="${SUITE:-bookworm}"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
HOST_PY="${HOST_VENV:-$HERE/.venv}/bin/python"
LOG="${ARM64_LOG:-/tmp/anima-arm64-check.log}"
say() { echo "arm64-check: $*"; }

[[ $(id -u) == 0 ]] || { say "needs root (debootstrap, chroot, binfmt_misc)"; exit 1; }
# 1) the tools, from Debian's packages
if ! command -v debootstrap >/dev/null || ! [[ -x /usr/libexec/qemu-binfmt/aarch64-binfmt-P ]]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap qemu-user-static
fi
# 2) binfmt_misc: aarch64 ELF files run through qemu (F: the interpreter is opened now, so it works inside the chroot)
if [[ ! -e /proc/sys/fs/binfmt_misc/register ]]; then
  mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc || { say "cannot mount binfmt_misc"; exit 1; }
fi
if [[ ! -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ]]; then
  sed 's/:OPF$/:OCPF/; s/:OP$/:OCPF/' /usr/lib/binfmt.d/qemu-aarch64.conf > /proc/sys/fs/binfmt_misc/register \
    || { say "cannot register qemu-aarch64 with binfmt_misc"; exit 1; }
fi
say "binfmt: $(head -1 /proc/sys/fs/binfmt_misc/qemu-aarch64) $(sed -n 2p /proc/sys/fs/binfmt_misc/qemu-aarch64)"

# 3) the Debian arm64 root (kept: a second run starts here)
if [[ ! -f "$ROOTFS/.anima-root-ok" ]]; then
  rm -rf "$ROOTFS"
  say "debootstrap $SUITE arm64 into $ROOTFS (minutes under emulation; log $LOG)"
  debootstrap --arch=arm64 --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$ROOTFS" \
    "$MIRROR" >"$LOG" 2>&1 || { say "debootstrap failed, last lines:"; tail -20 "$LOG"; exit 1; }
  touch "$ROOTFS/.anima-root-ok"
fi
say "root: $(chroot "$ROOTFS" uname -m) $(chroot "$ROOTFS" python3 --version)"

# 4) what goes in: the source tree and a tiny pack with one compiled branch (host: .venv + .venv-rknn)
ASSETS="$ROOTFS/anima"
rm -rf "$ASSETS" && mkdir -p "$ASSETS/src"
git -C "$HERE" ls-files -z --cached --others --exclude-standard | (cd "$HERE" && xargs -0 cp --parents -t "$ASSETS/src" 2>/dev/null || true)
PACK_CACHE="${ARM64_PACK:-/var/tmp/anima-arm64-pack}"
if [[ ! -f "$PACK_CACHE/manifest.json" ]] || ! grep -q '"rknn"' "$PACK_CACHE/manifest.json"; then
  PYTHONPATH="$HERE" "$HOST_PY" -c "import sys; from models.dit.synth import write_dit; write_dit('tiny', 0, sys.argv[1], prefix='net.')" "$PACK_CACHE.dit.safetensors"
  PYTHONPATH="$HERE" "$HOST_PY" -m models.commands.cli pack "$PACK_CACHE.dit.safetensors" --out "$PACK_CACHE" --resolution 128x128 --dtype fp16 --overwrite
  PYTHONPATH="$HERE" "$HOST_PY" -m models.commands.cli compile "$PACK_CACHE" --target rk3588 --blocks 0
fi
cp -r "$PACK_CACHE" "$ASSETS/pack"

# 5) inside: a venv, pip install '.[board]', the import, load_rknn + init_runtime without an NPU
for d in proc sys dev; do mountpoint -q "$ROOTFS/$d" || mount --bind "/$d" "$ROOTFS/$d"; done
cleanup() { for d in dev sys proc; do umount -l "$ROOTFS/$d" 2>/dev/null || true; done; }
trap cleanup EXIT
cp /etc/resolv.conf "$ROOTFS/etc/resolv.conf"
# pip inside the root trusts what this machine's pip trusts (its CA bundle), and reads no host pip settings
cp "${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" "$ROOTFS/etc/ssl/certs/anima-host-ca.crt"
IN=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C.UTF-8 PIP_CERT=/etc/ssl/certs/anima-host-ca.crt
    PIP_DISABLE_PIP_VERSION_CHECK=1)
start=$(date +%s)
chroot "$ROOTFS" "${IN[@]}" /bin/sh -c 'rm -rf /venv && python3 -m venv /venv && /venv/bin/python -m pip install -q --no-compile --upgrade pip && cd /anima/src && /venv/bin/python -m pip install -q --no-compile ".[board]"' \
  || { say "pip install '.[board]' FAILED in the arm64 root"; exit 1; }
say "pip install '.[board]' in the arm64 root: ok in $(( $(date +%s) - start )) s; $(chroot "$ROOTFS" "${IN[@]}" /venv/bin/python -m pip list 2>/dev/null | grep -iE 'rknn|onnxruntime|numpy ' | tr -s ' ' | tr '\n' ';')"
chroot "$ROOTFS" "${IN[@]}" /venv/bin/python - <<'PY'
import glob, json, os, platform, sys, traceback
print(f"arm64-check: python {platform.python_version()} on {platform.machine()}")
for m in ("torch", "transformers", "onnx"):
    try:
        __import__(m)
        print(f"arm64-check: {m} IMPORTABLE (must not be)")
    except ImportError:
        pass
from rknnlite.api import RKNNLite
from importlib.metadata import version
print(f"arm64-check: from rknnlite.api import RKNNLite: ok (rknn-toolkit-lite2 {version('rknn-toolkit-lite2')})")
import models.runtime.backends.rknn as be
pack = "/anima/pack"
m = json.load(open(f"{pack}/manifest.json"))
print(f"arm64-check: toolkit check against the pack: {be.check_toolkit_version(pack, __import__('rknnlite.api'))}"
      f" (pack compiled by rknn-toolkit2 {m['rknn']['toolkit']})")
path = next(f"{pack}/{b['rknn']['file']}" for b in m["branches"] if isinstance(b.get("rknn"), dict))
print(f"arm64-check: NPU device nodes here: {glob.glob('/dev/dri/*') + glob.glob('/dev/rknpu*') or 'none'}")
lite = RKNNLite(verbose=False)
try:
    ret = lite.load_rknn(path)
    print(f"arm64-check: load_rknn({os.path.basename(path)}) returned {ret!r}")
    ret = lite.init_runtime(core_mask=RKNNLite.NPU_CORE_0)
    print(f"arm64-check: init_runtime(core_mask=NPU_CORE_0) returned {ret!r}")
    if ret != 0:        # the SoC is found from the device tree; name it, to see the next step fail as it does
        ret = lite.init_runtime(target="rk3588", core_mask=RKNNLite.NPU_CORE_0)
        print(f"arm64-check: init_runtime(target='rk3588', core_mask=NPU_CORE_0) returned {ret!r}")
except BaseException as e:  # reported as it is
    print(f"arm64-check: raised {type(e).__name__}: {e}")
    traceback.print_exc(limit=3)
finally:
    try:
        lite.release()
    except Exception as e:
        print(f"arm64-check: release raised {e!r}")
PY
say "done (root kept at $ROOTFS)"
if [[ "${KEEP:-1}" == 0 ]]; then cleanup; trap - EXIT; rm -rf "$ROOTFS"; fi
