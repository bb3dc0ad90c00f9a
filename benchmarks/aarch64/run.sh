#!/usr/bin/env bash
# odtrain on aarch64 (a Raspberry Pi's Debian bookworm userland) under qemu user-mode emulation.
#
# 1. sysroot: Debian bookworm arm64 .debs of python3.11 and the C/C++ runtime it needs, fetched
#    with apt-get through a private apt configuration (nothing is added to the system's apt or dpkg)
#    and unpacked with dpkg -x;
# 2. qemu: qemu-aarch64-static from Debian's qemu-user-static .deb (unpacked, not installed);
# 3. wheels: odtrain's wheel, made as README says for a device (`ODTRAIN_BUILD_LIBRARY=0 pip wheel --no-deps .`
#    in a copy of the checkout: pure Python, py3-none-any), installed for manylinux2014_aarch64, and the
#    aarch64 wheels of its dependencies, installed into a target folder with the host's pip;
# 4. the kernel library: this host builds it for aarch64 (`odtrain compile --target aarch64`) for the
#    reference MLP's and CNN's artifacts; the emulated Python, with odtrain and numpy only installed (no
#    numba, llvmlite, scipy or onnx), trains them along PyTorch's golden losses through it and checks
#    that no compiler module was loaded (check_library.py); skipped, saying so, without a cross compiler
#    (gcc-aarch64-linux-gnu or ODTRAIN_CROSS_CC);
# 5. runs, emulated, with every dependency installed: the imports, the golden MLP training test, the CNN
#    check (tests/test_vision.py when it exists, else check_cnn.py against this machine's own losses),
#    and the cold start (`odtrain warmup`, then a first step in a new process).
# Prints how long each phase took. Emulated time is not Raspberry Pi time: qemu translates every
# instruction, so use the phases' proportions, not their seconds.
#
# Downloads are kept in $ODTRAIN_AARCH64_CACHE (default ~/.cache/odtrain-aarch64): a rerun only
# rebuilds odtrain's wheel and runs the checks again.
#
# Environment: ODTRAIN_AARCH64_CACHE, ODTRAIN_DEBIAN_MIRROR (default: this machine's Debian
# mirror, else http://deb.debian.org/debian), ODTRAIN_QEMU_CPU (default cortex-a72, a Pi 4's core),
# ODTRAIN_AARCH64_TESTS (pytest arguments replacing the default test selection),
# ODTRAIN_AARCH64_REFRESH=1 (resolve and install the dependency wheels again),
# ODTRAIN_AARCH64_PHASES=library (only 1-4: no numba, scipy or onnx wheel is fetched),
# ODTRAIN_HOST_PYTHON (the host's Python, with odtrain's build dependencies; default python3),
# ODTRAIN_CROSS_CC (the cross compiler; default aarch64-linux-gnu-gcc, from gcc-aarch64-linux-gnu).
set -euo pipefail

# The whole script is one function, read completely before it runs.
main() {

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
CACHE="${ODTRAIN_AARCH64_CACHE:-$HOME/.cache/odtrain-aarch64}"
QEMU_CPU_NAME="${ODTRAIN_QEMU_CPU:-cortex-a72}"
PY="${ODTRAIN_HOST_PYTHON:-python3}"
ONLY_LIBRARY=0
[ "${ODTRAIN_AARCH64_PHASES:-all}" = library ] && ONLY_LIBRARY=1
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
for tool in apt-get dpkg "$PY"; do
  command -v "$tool" > /dev/null || { echo "run.sh needs $tool (a Debian or Ubuntu host with Python 3 and pip)"; exit 1; }
done
HOST_ARCH="$(dpkg --print-architecture)"
PLATFORMS=(--platform manylinux_2_28_aarch64 --platform manylinux2014_aarch64
           --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311)

# Debian arm64 packages of the sysroot: python3.11 and the shared libraries its modules load.
SYSROOT_PACKAGES=(
  python3.11-minimal libpython3.11-minimal libpython3.11-stdlib
  libc6 zlib1g libexpat1 libgcc-s1 libstdc++6 libgomp1 libffi8
  libssl3
)

mkdir -p "$CACHE"
CACHE="$(cd "$CACHE" && pwd)"
SYSROOT="$CACHE/sysroot"
QEMU_DIR="$CACHE/qemu"
QEMU="$QEMU_DIR/usr/bin/qemu-aarch64-static"
WHEELS="$CACHE/wheels"
DEPS="$CACHE/site-deps"
DEVICE_SITE="$CACHE/site-numpy"  # numpy alone: the device of the kernel library
RUN="$CACHE/run"

# ---- timing -------------------------------------------------------------------------------------
PHASES=()
phase_start() { PHASE_NAME="$1"; PHASE_T0=$(date +%s.%N); echo; echo "=== $1"; }
phase_end() {
  local t1 seconds
  t1=$(date +%s.%N)
  seconds=$(awk -v a="$PHASE_T0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  PHASES+=("$(printf '%-50s %8s s  %s' "$PHASE_NAME" "$seconds" "${1:-}")")
  echo "--- $PHASE_NAME: ${seconds} s ${1:-}"
}
summary() {
  local status=$?
  echo
  echo "=== phases (emulated time is not Raspberry Pi time)"
  local line
  for line in "${PHASES[@]}"; do echo "$line"; done
  [ "$status" -eq 0 ] && echo "aarch64 run: all checks passed" || echo "aarch64 run: FAILED (exit $status) in: ${PHASE_NAME:-setup}"
}
trap summary EXIT

# ---- private apt configuration ------------------------------------------------------------------
debian_mirror() {
  if [ -n "${ODTRAIN_DEBIAN_MIRROR:-}" ]; then echo "$ODTRAIN_DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(cat /etc/apt/sources.list.d/*.sources 2>/dev/null | awk '/^URIs:/ { for (i = 2; i <= NF; i++) print $i }' \
        | grep -E '/debian/?$' | head -n1 || true)
  if [ -z "$uri" ]; then
    uri=$(grep -hE '^deb ' /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null \
          | awk '{ for (i = 2; i <= NF; i++) if ($i ~ /^(https?|file):/) { print $i; break } }' \
          | grep -E '/debian/?$' | head -n1 || true)
  fi
  echo "${uri:-http://deb.debian.org/debian}"
}

APT_DIR="$CACHE/apt"
APT_OPTS=(
  -o "APT::Architecture=$HOST_ARCH" -o "APT::Architectures::=$HOST_ARCH" -o "APT::Architectures::=arm64"
  -o "Dir::State=$APT_DIR/state" -o "Dir::State::status=$APT_DIR/state/status"
  -o "Dir::Cache=$APT_DIR/cache" -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache="
  -o "Dir::Etc::SourceList=$APT_DIR/sources.list" -o "Dir::Etc::SourceParts=$APT_DIR/sources.list.d"
  -o "Dir::Etc::Preferences=$APT_DIR/preferences" -o "Dir::Etc::PreferencesParts=$APT_DIR/preferences.d"
  -o "Debug::NoLocking=1" -o "APT::Get::AllowUnauthenticated=false"
)
# As root, apt hands downloads to the _apt user, who cannot write into a private folder under $HOME.
[ "$(id -u)" = 0 ] && APT_OPTS+=(-o "APT::Sandbox::User=root")
private_apt() { apt-get -q "${APT_OPTS[@]}" "$@"; }

setup_apt() {
  mkdir -p "$APT_DIR/state/lists/partial" "$APT_DIR/cache/archives/partial" "$APT_DIR/sources.list.d" \
           "$APT_DIR/preferences.d"
  touch "$APT_DIR/state/status" "$APT_DIR/preferences"
  local mirror keyring=/usr/share/keyrings/debian-archive-keyring.gpg
  mirror="$(debian_mirror)"
  local signed=""
  [ -f "$keyring" ] && signed=" signed-by=$keyring"
  cat > "$APT_DIR/sources.list.new" <<EOF
deb [arch=$HOST_ARCH,arm64$signed] $mirror bookworm main
deb [arch=$HOST_ARCH,arm64$signed] $mirror bookworm-updates main
EOF
  if ! cmp -s "$APT_DIR/sources.list.new" "$APT_DIR/sources.list"; then
    mv "$APT_DIR/sources.list.new" "$APT_DIR/sources.list"
    rm -f "$APT_DIR/updated"
  else
    rm -f "$APT_DIR/sources.list.new"
  fi
  # Package lists are refreshed once a day; a download that 404s refreshes them too.
  if [ -z "$(find "$APT_DIR/updated" -mmin -1440 2>/dev/null)" ]; then
    private_apt update
    touch "$APT_DIR/updated"
  fi
}

# download PKG... into DIR (each package's candidate version; a .deb already there is kept)
download_debs() {
  local dir="$1"; shift
  mkdir -p "$dir"
  local uris
  if ! uris=$(private_apt -qq --print-uris download "$@" 2>/dev/null); then
    private_apt update; touch "$APT_DIR/updated"  # the lists were stale, or a package is new
    uris=$(private_apt -qq --print-uris download "$@")
  fi
  local missing=() pkg file
  for pkg in "$@"; do
    file=$(awk -v p="${pkg%%:*}" 'index($2, p "_") == 1 { print $2 }' <<< "$uris" | head -n1)
    [ -n "$file" ] && [ -s "$dir/$file" ] || missing+=("$pkg")
  done
  if [ "${#missing[@]}" -gt 0 ]; then
    (cd "$dir" && private_apt download "${missing[@]}")
  fi
}

# ---- 1. sysroot ---------------------------------------------------------------------------------
phase_start "arm64 sysroot (Debian bookworm .debs)"
setup_apt
ARM_PKGS=()
for p in "${SYSROOT_PACKAGES[@]}"; do ARM_PKGS+=("$p:arm64"); done
download_debs "$CACHE/debs-arm64" "${ARM_PKGS[@]}"
STAMP_SYSROOT="$(cd "$CACHE/debs-arm64" && ls -1 *.deb | sort | sha256sum | cut -c1-16)"
if [ "$(cat "$SYSROOT/.stamp" 2>/dev/null || true)" != "$STAMP_SYSROOT" ]; then
  rm -rf "$SYSROOT.tmp"
  mkdir -p "$SYSROOT.tmp"
  for p in "${SYSROOT_PACKAGES[@]}"; do
    deb=$(find "$CACHE/debs-arm64" -name "${p}_*_arm64.deb" -o -name "${p}_*_all.deb" | sort -V | tail -n1)
    [ -n "$deb" ] || { echo "no .deb for $p in $CACHE/debs-arm64"; exit 1; }
    dpkg -x "$deb" "$SYSROOT.tmp"
  done
  # The host's dist-packages must not leak into the emulated interpreter: qemu -L looks a path up
  # in the sysroot first and falls back to the host's, so empty folders here shadow the host's.
  mkdir -p "$SYSROOT.tmp/usr/lib/python3/dist-packages" "$SYSROOT.tmp/usr/local/lib/python3.11/dist-packages" \
           "$SYSROOT.tmp/usr/lib/python3.11/site-packages"
  echo "$STAMP_SYSROOT" > "$SYSROOT.tmp/.stamp"
  rm -rf "$SYSROOT"
  mv "$SYSROOT.tmp" "$SYSROOT"
fi
phase_end "($(du -sm "$SYSROOT" | cut -f1) MB)"

# ---- 2. qemu ------------------------------------------------------------------------------------
phase_start "qemu-aarch64-static (qemu-user-static .deb)"
if [ ! -x "$QEMU" ]; then
  download_debs "$CACHE/debs-host" "qemu-user-static:$HOST_ARCH"
  rm -rf "$QEMU_DIR.tmp"
  dpkg -x "$(find "$CACHE/debs-host" -name 'qemu-user-static_*.deb' | sort -V | tail -n1)" "$QEMU_DIR.tmp"
  rm -rf "$QEMU_DIR"
  mv "$QEMU_DIR.tmp" "$QEMU_DIR"
fi
"$QEMU" -version | head -n1
phase_end "(cpu $QEMU_CPU_NAME)"

# Everything emulated runs through this: the sysroot's python3.11 on qemu, with no host Python
# paths, the x86 OpenBLAS core settings removed (they name x86 cores), and the target folders.
emulated_python() {
  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE -u PYTHONHOME -u VIRTUAL_ENV \
    PYTHONNOUSERSITE=1 PYTHONPYCACHEPREFIX="$CACHE/pycache" \
    PYTHONPATH="$RUN/site-odtrain:${EMULATED_SITE:-$DEPS}" HOME="$RUN/home" \
    "$QEMU" -cpu "$QEMU_CPU_NAME" -L "$SYSROOT" "$SYSROOT/usr/bin/python3.11" "$@"
}

# ---- 3. wheels ----------------------------------------------------------------------------------
phase_start "odtrain wheel; aarch64 dependency wheels installed"
rm -rf "$RUN"
mkdir -p "$RUN/dist" "$RUN/home" "$WHEELS"
# The device's wheel as README says to make it: `ODTRAIN_BUILD_LIBRARY=0 pip wheel --no-deps .` in the checkout
# (setup.py included), pure Python. Built from a copy of the checkout's files, so that the build leaves nothing
# in the source tree; a library built in the package folder (odtrain/data/kernels) is left out, as git does.
mkdir -p "$RUN/src"
if git -C "$ROOT" rev-parse --git-dir > /dev/null 2>&1; then
  (cd "$ROOT" && git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$RUN/src" 2>/dev/null || true)
else
  cp -r "$ROOT/." "$RUN/src/"
  rm -rf "$RUN/src/odtrain/data/kernels"
fi
find "$RUN/src" -name __pycache__ -prune -exec rm -rf {} +
(cd "$RUN/src" && ODTRAIN_BUILD_LIBRARY=0 "$PY" -m pip wheel -q --no-deps -w "$RUN/dist" .)
WHEEL="$(ls -1 "$RUN/dist"/odtrain-*.whl | head -n1)"
case "$WHEEL" in
  *-py3-none-any.whl) ;;
  *) echo "the device's wheel is not pure Python: $WHEEL (setup.py marks it as holding native code)"; exit 1 ;;
esac
# Dependencies, with the test extra (pytest, hypothesis, onnxruntime when it has an aarch64 wheel),
# resolved again when pyproject.toml's dependencies change (or with ODTRAIN_AARCH64_REFRESH=1).
STAMP_DEPS="$( ("$PY" -c 'import sys
try:
    import tomllib
except ImportError:  # Python 3.10: the whole file
    print(open(sys.argv[1]).read()); sys.exit()
p = tomllib.load(open(sys.argv[1], "rb"))["project"]
print(p["dependencies"], p.get("optional-dependencies", {}).get("test"))' "$ROOT/pyproject.toml"
  echo "${PLATFORMS[*]}") | sha256sum | cut -c1-16)"
if [ "$ONLY_LIBRARY" = 0 ] && { [ "$(cat "$DEPS/.stamp" 2>/dev/null || true)" != "$STAMP_DEPS" ] \
   || [ "${ODTRAIN_AARCH64_REFRESH:-0}" = 1 ]; }; then
  REQS=("$WHEEL[test]")
  if ! "$PY" -m pip download -q -d "$WHEELS" "${PLATFORMS[@]}" "${REQS[@]}" 2> "$RUN/pip-download.log"; then
    echo "no aarch64 wheel for every test dependency; retrying without onnxruntime"
    REQS=("$WHEEL" pytest hypothesis)
    "$PY" -m pip download -q -d "$WHEELS" "${PLATFORMS[@]}" "${REQS[@]}" 2> "$RUN/pip-download.log" \
      || { cat "$RUN/pip-download.log"; exit 1; }
  fi
  rm -f "$WHEELS"/odtrain-*.whl
  rm -rf "$DEPS.tmp"
  # The resolver picks the newest of the cached wheels; odtrain itself goes to its own folder.
  "$PY" -m pip install -q --no-warn-conflicts --no-index --find-links "$WHEELS" --find-links "$RUN/dist" \
    --target "$DEPS.tmp" "${PLATFORMS[@]}" "${REQS[@]}"
  rm -rf "$DEPS.tmp"/odtrain "$DEPS.tmp"/odtrain-*.dist-info "$DEPS.tmp/bin"
  echo "$STAMP_DEPS" > "$DEPS.tmp/.stamp"
  rm -rf "$DEPS"
  mv "$DEPS.tmp" "$DEPS"
fi
"$PY" -m pip install -q --no-warn-conflicts --no-index --no-deps --target "$RUN/site-odtrain" "${PLATFORMS[@]}" "$WHEEL"
# The kernel library's device: numpy, the version this host builds with
NUMPY_VERSION="$("$PY" -c 'import numpy; print(numpy.__version__)')"
if [ "$(cat "$DEVICE_SITE/.stamp" 2>/dev/null || true)" != "$NUMPY_VERSION" ]; then
  "$PY" -m pip download -q -d "$WHEELS" "${PLATFORMS[@]}" "numpy==$NUMPY_VERSION"
  rm -rf "$DEVICE_SITE"
  "$PY" -m pip install -q --no-index --find-links "$WHEELS" --target "$DEVICE_SITE" "${PLATFORMS[@]}" \
    "numpy==$NUMPY_VERSION"
  rm -rf "$DEVICE_SITE/bin"
  echo "$NUMPY_VERSION" > "$DEVICE_SITE/.stamp"
fi
phase_end "(odtrain $(basename "$WHEEL"), numpy $NUMPY_VERSION)"

# ---- emulated checks -------------------------------------------------------------------------
phase_start "emulated: python3.11 starts"
emulated_python - "$CACHE" <<'EOF'
import os, platform, sys
print(" ", platform.machine(), "Python", sys.version.split()[0], "| sys.path:", " ".join(sys.path[1:]))
shadowed = {"/usr/lib/python3/dist-packages", "/usr/local/lib/python3.11/dist-packages"}
outside = [p for p in sys.path[1:] if not p.startswith(sys.argv[1]) and p not in shadowed]
assert platform.machine() == "aarch64" and not outside, f"host paths in sys.path: {outside}"
EOF
phase_end

# ---- 4. the kernel library, built here for aarch64; the device has numpy and odtrain only -----------
LIBRARY_RUN="$RUN/library"
CROSS_CC_FOUND=1
if [ -z "${ODTRAIN_CROSS_CC:-}" ] && ! command -v aarch64-linux-gnu-gcc > /dev/null; then
  CROSS_CC_FOUND=0
  echo "no cross compiler (apt-get install gcc-aarch64-linux-gnu, or ODTRAIN_CROSS_CC): the kernel library phase is skipped"
  [ "$ONLY_LIBRARY" = 1 ] && exit 1
fi
if [ "$CROSS_CC_FOUND" = 1 ]; then
  phase_start "host: reference artifacts (mlp, cnn; SGD, AdamW)"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/check_library.py" --prepare "$LIBRARY_RUN"
  phase_end

  phase_start "host: odtrain compile --target aarch64 --cpu $QEMU_CPU_NAME"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m odtrain compile "$LIBRARY_RUN"/{mlp,cnn}-{sgd,adamw} \
    -o "$LIBRARY_RUN/kernels" --target aarch64 --cpu "$QEMU_CPU_NAME"
  phase_end "($(du -k "$LIBRARY_RUN/kernels/libodtrain_kernels.so" | cut -f1) KiB)"

  phase_start "emulated: golden trajectories through the library, numpy only"
  EMULATED_SITE="$DEVICE_SITE" ODTRAIN_KERNEL_LIBRARY="$LIBRARY_RUN/kernels" \
    emulated_python "$HERE/check_library.py" --run "$LIBRARY_RUN"
  phase_end
fi

if [ "$ONLY_LIBRARY" = 1 ]; then
  exit 0
fi

# ---- 5. emulated, with every dependency installed --------------------------------------------------
phase_start "emulated: import numpy, scipy, numba, onnx"
emulated_python - <<'EOF'
import time
for name in ("numpy", "scipy.linalg.cython_blas", "numba", "onnx", "safetensors", "odtrain.api"):
    t = time.perf_counter()
    module = __import__(name)
    print(f"  import {name:<26} {time.perf_counter() - t:6.1f} s  {getattr(module, '__version__', '')}")
import llvmlite.binding
print("  LLVM host CPU:", llvmlite.binding.get_host_cpu_name())
EOF
phase_end

# Tests run from a copy, with the package installed from its wheel (not the checkout), and a
# fresh Numba cache: each run compiles every kernel it needs, as a new device would.
mkdir -p "$RUN/tests/data"
cp "$ROOT/tests/conftest.py" "$RUN/tests/"
[ -f "$ROOT/tests/oracles.py" ] && cp "$ROOT/tests/oracles.py" "$RUN/tests/"
cp -r "$ROOT/tests/data/mlp" "$RUN/tests/data/"
TESTS=(tests/test_golden_mlp.py)
cp "$ROOT/tests/test_golden_mlp.py" "$RUN/tests/"
# The CNN: the PyTorch-exported cnn along its golden losses (tests/test_vision.py) when that test
# exists, else check_cnn.py (a small Conv model, its losses against this machine's).
CNN_TEST=test_cnn_follows_golden_losses
HAVE_CNN_TEST=0
if [ -f "$ROOT/tests/test_vision.py" ] && grep -q "def $CNN_TEST" "$ROOT/tests/test_vision.py" \
   && [ -d "$ROOT/tests/data/cnn" ]; then
  HAVE_CNN_TEST=1
  cp "$ROOT/tests/test_vision.py" "$RUN/tests/"
  cp -r "$ROOT/tests/data/cnn" "$RUN/tests/data/"
  TESTS+=("tests/test_vision.py::$CNN_TEST")
fi
printf '[pytest]\naddopts = -p no:cacheprovider\nmarkers =\n    slow: longer end-to-end runs\n' > "$RUN/pytest.ini"

phase_start "emulated: pytest"
if [ -n "${ODTRAIN_AARCH64_TESTS:-}" ]; then
  read -r -a TESTS <<< "$ODTRAIN_AARCH64_TESTS"
fi
(cd "$RUN" && ODTRAIN_CACHE_DIR="$RUN/numba-cache-tests" emulated_python -m pytest -q -rA "${TESTS[@]}")
phase_end "(${TESTS[*]})"

if [ "$HAVE_CNN_TEST" = 0 ]; then
  phase_start "CNN check: reference losses on this host"
  PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$HERE/check_cnn.py" --write "$RUN/cnn-reference"
  phase_end
  if [ -f "$RUN/cnn-reference/losses.json" ]; then
    phase_start "emulated: CNN check against the host's losses"
    (cd "$RUN" && ODTRAIN_CACHE_DIR="$RUN/numba-cache-tests" emulated_python "$HERE/check_cnn.py" \
       --compare "$RUN/cnn-reference")
    phase_end
  fi
fi

# ---- cold start, emulated --------------------------------------------------------------------
phase_start "emulated: odtrain warmup (fills an empty cache)"
(cd "$RUN" && ODTRAIN_CACHE_DIR="$RUN/numba-cache-warmup" emulated_python -m odtrain warmup)
phase_end

phase_start "emulated: first step after warmup, new process"
(cd "$RUN" && ODTRAIN_CACHE_DIR="$RUN/numba-cache-warmup" emulated_python "$HERE/first_step.py" --demo \
   --expect-no-compile)
phase_end
}

main "$@"; exit
