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
# 2. pydantic and its parts, typing_extensions too where the interpreter's is older than
#    pydantic needs (TE_MIN);
# 3. DeepSpeed and hjson into /tmp/site_ds, on the path only of what compares with DeepSpeed
#    (so the tests run as CI's do without it); libaio's packages unpacked under /tmp/libaio for
#    DeepSpeed's NVMe op, and /tmp/gpu_env.sh, which exports both for a later command;
# 4. the package itself, editable: `pip install --no-index --no-deps --no-build-isolation -e .`
#    (it compiles both native modules, and puts the DeepSpeed opt-in's .pth in site-packages).
#
# Where the interpreter's environment is not writable (a read-only image), 1, 2 and 4 go to a
# target folder instead ($GPU_INSTALL_TARGET, default /tmp/zero_offload_site): the wheels
# installed there, the native modules built in place in src/, the opt-in's .pth and a
# sitecustomize.py that reads it (a .pth on PYTHONPATH is not read by itself). The PYTHONPATH
# the later steps need (that folder, then src/) is written to $GPU_CHECK_STATE/pythonpath, which
# scripts/gpu_check.py puts in front of every later step's PYTHONPATH.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
STATE=${GPU_CHECK_STATE:-/tmp/zero_offload_gpu_check}
TARGET=${GPU_INSTALL_TARGET:-/tmp/zero_offload_site}
TE_MIN=4.14.1  # pydantic 2.13's typing_extensions>=4.14.1
check=0
[ "${1:-}" = "--check" ] && check=1
run() {  # a step of the install; with --check only printed
  echo "+ $*"
  ((check)) || "$@" || { echo "install: failed: $*"; exit 2; }
}
wheels() { ls .whl/*.whl 2>/dev/null | grep "$@"; }
missing() {  # what is needed and not carried: the end of an install, a note of a check
  echo "install: $*"
  ((check)) || exit 2
}

# Where this interpreter installs: its environment, or the target folder where that is not
# writable (os.access sees a read-only file system, also as root).
if "$PY" -c "import os, sys, sysconfig; sys.exit(not os.access(sysconfig.get_paths()['purelib'], os.W_OK))"; then
  into=()
  echo "install: into the interpreter's environment"
  ((check)) || rm -f "$STATE/pythonpath"  # an earlier fallback's, no longer wanted
else
  into=(--target "$TARGET" --upgrade)
  mkdir -p "$TARGET" "$STATE"
  echo "install: the interpreter's environment is not writable: into $TARGET (on PYTHONPATH)"
  ((check)) || printf '%s\n' "$TARGET:$PWD/src" >"$STATE/pythonpath"
  export PYTHONPATH="$TARGET:$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
pipi() { "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir "$@"; }

if ! "$PY" - <<'PY'
import sys
import setuptools, wheel  # noqa: E401,F401
sys.exit(int(setuptools.__version__.split(".")[0]) < 77)
PY
then
  w=$(wheels -e '/setuptools-' -e '/wheel-')
  if [ -n "$w" ]; then run pipi --upgrade "${into[@]}" $w; else missing "setuptools>=77 and wheel: none in .whl/"; fi
fi
if ! "$PY" - "$TE_MIN" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
have = tuple(int(x) for x in version("typing_extensions").split(".")[:3])
sys.exit(have < tuple(int(x) for x in sys.argv[1].split(".")))
PY
then
  w=$(wheels -e '/typing_extensions-')
  if [ -n "$w" ]; then run pipi --upgrade "${into[@]}" $w; else missing "typing_extensions>=$TE_MIN: none in .whl/"; fi
fi
if ! "$PY" -c "import pydantic" 2>/dev/null; then
  w=$(wheels -e pydantic -e annotated_types -e typing_inspection)
  if [ -n "$w" ]; then run pipi "${into[@]}" $w; else missing "pydantic: none in .whl/ (gpu_wheels.sh)"; fi
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
if ((${#into[@]} == 0)); then
  run pipi -e .
else  # the package from src/ on PYTHONPATH: its native modules built in place, the .pth read
  run "$PY" setup.py -q build_ext --inplace
  if ((!check)); then
    "$PY" - "$TARGET" <<'PY' || { echo "install: failed: the opt-in's .pth"; exit 2; }
import ast, pathlib, sys
# setup.py's PTH_NAME and PTH_LINE, read without running setup()
found = {t.id: ast.literal_eval(n.value) for n in ast.parse(open("setup.py").read()).body
         if isinstance(n, ast.Assign) for t in n.targets
         if isinstance(t, ast.Name) and t.id in ("PTH_NAME", "PTH_LINE")}
(pathlib.Path(sys.argv[1]) / found["PTH_NAME"]).write_text(found["PTH_LINE"])
PY
    cat >"$TARGET/sitecustomize.py" <<'PY'
# Written by scripts/gpu_install.sh: this folder is on PYTHONPATH, where the interpreter reads no
# .pth file by itself; reading it as a site directory runs the DeepSpeed opt-in's .pth.
import os
import site

site.addsitedir(os.path.dirname(os.path.abspath(__file__)))
PY
  fi
fi
# Installed means: imported from this checkout, with the opt-in's .pth in a site directory.
"$PY" - <<'PY'
import pathlib, site, sys
import zero_offload
here = pathlib.Path.cwd() / "src" / "zero_offload"
dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
pth = sorted({d for d in dirs if (pathlib.Path(d) / "zero_offload_as_deepspeed.pth").exists()})
print("zero_offload from", pathlib.Path(zero_offload.__file__).parent, "| .pth in", pth)
sys.exit(0 if pth and pathlib.Path(zero_offload.__file__).parent.samefile(here) else 1)
PY
