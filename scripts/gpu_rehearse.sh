#!/usr/bin/env bash
# The GPU check's first lease, rehearsed on a machine without a GPU, as that machine runs it:
# Python 3.12 holding torch and nothing of this package's, no network, the wheels of .whl/ only.
#
#   bash scripts/gpu_rehearse.sh OUTDIR
#
# 1. .whl/ built where missing (scripts/gpu_wheels.sh, with the network) and checked
#    (scripts/gpu_wheels_check.py: every wheel the install needs, one version each, within the
#    64 MiB a call carries);
# 2. a base environment, made once and kept ($REHEARSE_CACHE): Python 3.12 (PYTHON312, else
#    python3.12 on PATH, else pyenv's) with torch $REHEARSE_TORCH (default 2.11.0, the GPU
#    machine's; PyPI's Linux build, CUDA libraries included, run here on the CPU; where it does
#    not install, $REHEARSE_TORCH_FALLBACK, default 2.13.0, and says so) and what that
#    machine's image has that the check uses (pytest, pytest-timeout, numpy), typing_extensions held
#    older than pydantic needs (the machine's version is not known: the carried one must win);
# 3. twice, each in a throwaway venv that sees the base's packages and in a network namespace
#    with no network (`unshare -rn`), `scripts/gpu_check.sh --install`: the install runs for
#    real from .whl/ and passes (the namespace's loopback up, as the GPU machine's: the benchmarks'
#    ranks meet on 127.0.0.1), smoke trains on the CPU, the CUDA steps run their wiring and
#    are reported skipped. OUTDIR/writable: the venv writable (installed into it, editable);
#    OUTDIR/readonly: the venv mounted read-only (`unshare -rnm`), the install falls back to a
#    target folder on PYTHONPATH (install and smoke only).
# Exits 0 when both pass; prints the two tables and which torch ran.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:?usage: gpu_rehearse.sh OUTDIR}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
TORCH=${REHEARSE_TORCH:-2.11.0}
CACHE=${REHEARSE_CACHE:-$HOME/.cache/zero_offload/rehearse}
OLD_TE=4.12.2  # typing_extensions older than pydantic 2.13's >= 4.14.1
t0=$SECONDS

# 1. the wheels
if ! ls .whl/pydantic-*.whl >/dev/null 2>&1; then
  echo "== .whl/ missing: scripts/gpu_wheels.sh"
  bash scripts/gpu_wheels.sh >"$OUT/wheels.log" 2>&1 || { tail "$OUT/wheels.log"; exit 2; }
fi
py_here=${PYTHON:-python3}
"$py_here" scripts/gpu_wheels_check.py .whl || exit 2

# 2. the base environment (made once)
py312=
for c in ${PYTHON312:-} $(command -v python3.12) "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12; do
  if "$c" -c "import sys; sys.exit(sys.version_info[:2] != (3, 12))" 2>/dev/null; then py312=$c; break; fi
done
[ -n "$py312" ] || { echo "rehearse: no Python 3.12 (set PYTHON312)"; exit 2; }
make_base() {  # $1: torch's version; sets base; fails where that torch does not install
  base="$CACHE/torch-$1-py312"
  local reqs=("torch==$1" pytest pytest-timeout numpy "typing_extensions==$OLD_TE")
  [ "$(cat "$base/ready" 2>/dev/null)" = "${reqs[*]}" ] && return 0
  echo "== base environment: ${reqs[*]} on $("$py312" -V) into $base (once)"
  { [ -x "$base/bin/python" ] || "$py312" -m venv "$base"; } &&
    "$base/bin/python" -m pip install -q "${reqs[@]}" >"$OUT/base.log" 2>&1 &&
    echo "${reqs[*]}" >"$base/ready"
}
# The GPU machine's torch where it installs (PyPI's Linux wheel: a CUDA build, about 4 GB with
# its CUDA libraries, once), else $REHEARSE_TORCH_FALLBACK (default 2.13.0, CI's).
if ! make_base "$TORCH"; then
  tail -3 "$OUT/base.log"
  echo "rehearse: torch $TORCH does not install here: torch ${REHEARSE_TORCH_FALLBACK:-2.13.0} instead"
  make_base "${REHEARSE_TORCH_FALLBACK:-2.13.0}" || { tail "$OUT/base.log"; exit 2; }
fi
base_site=$("$base/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
torch_ver=$("$base/bin/python" -c "import torch; print(torch.__version__)")
echo "== torch $torch_ver, $("$base/bin/python" -V), from $base"

# 3. the check, offline, in throwaway venvs
tmp=$(mktemp -d /tmp/gpu_rehearse.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
venv() {  # a venv that sees the base's packages after its own (a .pth: the base stays as it is)
  "$py312" -m venv --without-pip "$1" &&
    "$1/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" |
    { read -r site; echo "$base_site" >"$site/zz_rehearse_base.pth"; }
}
# Only the carried wheels are to be found, as there: no pip configuration of this machine.
offline=(env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PYTHONPATH
         PIP_CONFIG_FILE=/dev/null)
venv "$tmp/rw" && venv "$tmp/ro" || exit 2
echo "== writable venv: gpu_check.sh --install, offline"
"${offline[@]}" PYTHON="$tmp/rw/bin/python" GPU_CHECK_STATE="$tmp/state_rw" \
  unshare -rn bash -c 'ip link set lo up && exec "$@"' _ \
  bash scripts/gpu_check.sh "$OUT/writable" --install
rc_rw=$?
echo "== read-only venv: gpu_check.sh --install --steps install smoke, offline"
"${offline[@]}" PYTHON="$tmp/ro/bin/python" GPU_CHECK_STATE="$tmp/state_ro" \
  GPU_INSTALL_TARGET="$tmp/site" unshare -rnm bash -c 'ip link set lo up &&
    mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"' _ "$tmp/ro" \
  bash scripts/gpu_check.sh "$OUT/readonly" --install --steps install smoke --cap 240
rc_ro=$?
grep -q "not writable" "$OUT/readonly/install.log" ||
  { echo "rehearse: the read-only venv was installed into"; rc_ro=1; }
echo "rehearse: torch $torch_ver; writable rc=$rc_rw, read-only rc=$rc_ro; $((SECONDS - t0)) s"
((rc_rw == 0 && rc_ro == 0))
