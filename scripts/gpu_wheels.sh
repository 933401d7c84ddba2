#!/usr/bin/env bash
# Wheels the GPU machine lacks, for Python 3.12 on x86-64 Linux, into .whl/ (git-ignored, carried
# along with the checkout): the build backend pyproject.toml names (setuptools>=77, wheel: that
# machine's setuptools may be older), pydantic (this package's config models) with its
# typing_extensions (pydantic 2.13 needs >= 4.14.1; that machine's version is not known) and what DeepSpeed
# needs beyond that machine's image (hjson), plus a DeepSpeed wheel built here without prebuilt
# ops (its ops JIT-compile there), and libaio's Debian packages for DeepSpeed's NVMe op.
# scripts/gpu_install.sh (the GPU check's install step) installs them with
# `pip install --no-index --no-deps`; scripts/gpu_rehearse.sh checks that they are all there
# and within the 64 MiB a lease carries. PYTHON: an interpreter with pip and torch (DeepSpeed's
# wheel is built with it; default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
DS_VERSION="${DS_VERSION:-0.19.8}"
mkdir -p .whl
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  plat+=(--platform "$p")
done
# One version of each (two versions of one name stop the whole install there).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp "${plat[@]}" -d .whl \
  pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
  typing-extensions==4.16.0 hjson==3.1.0 setuptools==84.2.1 wheel==0.48.0
if ! ls .whl/deepspeed-"$DS_VERSION"-*.whl >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  "$PY" -m pip download -q --no-deps --no-binary :all: "deepspeed==$DS_VERSION" -d "$tmp"
  DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation "$tmp"/deepspeed-*.tar.gz -w .whl
  rm -rf "$tmp"
fi
# libaio for DeepSpeed's NVMe op (the nvme part's anchor): Debian's packages, unpacked there by
# gpu_install.sh into /tmp/libaio.
if ! ls .whl/libaio-dev_*.deb >/dev/null 2>&1; then
  (cd .whl && apt-get download -q libaio-dev "$(apt-cache depends libaio-dev \
    | awk '/Depends: libaio/{print $2}')")
fi
ls -la .whl
