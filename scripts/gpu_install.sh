#!/usr/bin/env bash
# The GPU check's install step (scripts/gpu_check.sh), on a machine without network access whose
# Python has PyTorch, pytest and transformers but not pydantic or DeepSpeed: their wheels come
# along in .whl/ (made by scripts/gpu_wheels.sh on a machine with PyPI). Safe to run again.
#
#   bash scripts/gpu_install.sh           # install
#   bash scripts/gpu_install.sh --check   # change nothing: say what an install would do, and
#                                         # fail unless the package is installed already
#
# 1. the build backend pyproject.toml names (setuptools>=77, wheel), from .whl/ where the
#    interpreter's is older or missing;
# 2. pydantic and its parts into the interpreter's environment;
# 3. DeepSpeed and hjson into /tmp/site_ds, on the path only of what compares with DeepSpeed
#    (so the tests run as CI's do without it); libaio's packages unpacked under /tmp/libaio for
#    DeepSpeed's NVMe op, and /tmp/gpu_env.sh, which exports both for a later command;
# 4. the package itself, editable: `pip install --no-index --no-deps --no-build-isolation -e .`
#    (it compiles both native modules, and puts the DeepSpeed opt-in's .pth in site-packages).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
check=0
[ "${1:-}" = "--check" ] && check=1
pipi() { "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir "$@"; }
run() {  # a step of the install; with --check only printed
  echo "+ $*"
  ((check)) || "$@" || { echo "install: failed: $*"; exit 2; }
}
wheels() { ls .whl/*.whl 2>/dev/null | grep "$@"; }
missing() {  # what is needed and not carried: the end of an install, a note of a check
  echo "install: $*"
  ((check)) || exit 2
}

if ! "$PY" - <<'PY'
import sys
import setuptools, wheel  # noqa: E401,F401
sys.exit(int(setuptools.__version__.split(".")[0]) < 77)
PY
then
  w=$(wheels -e '/setuptools-' -e '/wheel-')
  if [ -n "$w" ]; then run pipi --upgrade $w; else missing "setuptools>=77 and wheel: none in .whl/"; fi
fi
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  w=$(wheels -e pydantic -e annotated_types -e typing_inspection)
  if [ -n "$w" ]; then run pipi $w; else missing "pydantic: none in .whl/ (gpu_wheels.sh)"; fi
fi
w=$(wheels -e '/deepspeed-' -e '/hjson-')
if [ -n "$w" ] && ! PYTHONPATH=/tmp/site_ds "$PY" -c "import deepspeed" >/dev/null 2>&1; then
  run pipi --no-compile --target /tmp/site_ds $w
fi
env_file=/tmp/gpu_env.sh
if ((!check)); then
  echo "export PYTHONPATH=/tmp/site_ds\${PYTHONPATH:+:\$PYTHONPATH}" >"$env_file"
  if ls .whl/libaio*.deb >/dev/null 2>&1; then
    for f in .whl/libaio*.deb; do dpkg -x "$f" /tmp/libaio; done
    lib=/tmp/libaio/usr/lib/x86_64-linux-gnu
    [ -e "$lib/libaio.so" ] || ln -sf "$(ls "$lib"/libaio.so.1* | head -1)" "$lib/libaio.so"
    stubs="${CUDA_HOME:-/usr/local/cuda}/lib64/stubs"  # DeepSpeed's op links -lcuda: the stub
    cat >>"$env_file" <<ENV
export CPATH=/tmp/libaio/usr/include\${CPATH:+:\$CPATH} CFLAGS=-I/tmp/libaio/usr/include
export LIBRARY_PATH=$lib:$stubs\${LIBRARY_PATH:+:\$LIBRARY_PATH} LDFLAGS=-L$lib
export LD_LIBRARY_PATH=$lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
ENV
  fi
fi
run pipi -e .
# Installed means: imported from this checkout, with the opt-in's .pth in a site directory.
"$PY" - <<'PY'
import pathlib, site, sys
import zero_offload
here = pathlib.Path.cwd() / "src" / "zero_offload"
pth = [d for d in [*site.getsitepackages(), site.getusersitepackages()]
       if (pathlib.Path(d) / "zero_offload_as_deepspeed.pth").exists()]
print("zero_offload from", pathlib.Path(zero_offload.__file__).parent, "| .pth in", pth)
sys.exit(0 if pth and pathlib.Path(zero_offload.__file__).parent.samefile(here) else 1)
PY
