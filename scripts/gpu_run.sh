#!/usr/bin/env bash
# Everything a GPU machine without network access runs, in a few calls. It has
# PyTorch, pytest and transformers but not pydantic or DeepSpeed: first, on a machine with
# PyPI, `bash scripts/gpu_wheels.sh` puts their wheels in .whl/ (git-ignored, carried along).
#
#   bash scripts/gpu_run.sh OUTDIR STEP...
#
# Steps, run in the order given:
#   cuda-tests   every test marked cuda: tests/test_cuda.py and the benchmarks' trace checks
#                (nothing may skip)
#   tests        the whole default suite with CUDA present (8 workers; tests not marked cuda
#                run on the CPU, see tests/conftest.py)
#   tests-on-gpu the same with ZERO_OFFLOAD_TEST_DEVICE=cuda: every engine on the GPU, to find
#                what is not device-agnostic (log: tests_on_gpu.log)
#   env pcie overlap sizes throughput throughput_large nvme
#                parts of benchmarks/gpu_suite.py (consecutive ones run in one call of it)
# Logs, JSON and the suite's Markdown land in OUTDIR.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu_run.sh OUTDIR STEP...}"
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD/src" TORCH_EXTENSIONS_DIR=/tmp/torch_ext

# pydantic (this package) into /tmp/site; DeepSpeed into /tmp/site_ds, on the path of the suite's
# parts only, so that the test steps run as CI does (DeepSpeed's optional parity tests skip).
install() {  # target, wheels...
  local target=$1; shift
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$target" "$@" || exit 2
}
ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run scripts/gpu_wheels.sh"; exit 2; }
python3 -c "import pydantic" 2>/dev/null \
  || install /tmp/site $(ls .whl/*.whl | grep -v -e deepspeed -e hjson)
PYTHONPATH=/tmp/site_ds:$PYTHONPATH python3 -c "import deepspeed" 2>/dev/null \
  || install /tmp/site_ds .whl/deepspeed-*.whl .whl/hjson-*.whl
if ! ls src/zero_offload/_host_adam*.so >/dev/null 2>&1; then
  python3 setup.py -q build_ext --inplace -j 16 >"$out/build.log" 2>&1 || { tail -20 "$out/build.log"; exit 2; }
fi
# libaio (headers and library) for DeepSpeed's NVMe op, the nvme part's anchor: unpacked beside
# the system, never into it, and found through the compiler's and loader's search paths.
if ls .whl/libaio*.deb >/dev/null 2>&1 && [ ! -d /tmp/libaio ]; then
  for f in .whl/libaio*.deb; do dpkg -x "$f" /tmp/libaio; done
fi
if [ -d /tmp/libaio ]; then
  aio_lib=/tmp/libaio/usr/lib/x86_64-linux-gnu
  [ -e "$aio_lib/libaio.so" ] || ln -sf "$(ls "$aio_lib"/libaio.so.1* | head -1)" "$aio_lib/libaio.so"
  export CPATH=/tmp/libaio/usr/include${CPATH:+:$CPATH} CFLAGS="-I/tmp/libaio/usr/include"
  export LIBRARY_PATH=$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH} LDFLAGS="-L$aio_lib"
  export LD_LIBRARY_PATH=$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  # On CUDA the op also links -lcuda: the toolkit's stub (the driver has only libcuda.so.1).
  stubs="${CUDA_HOME:-/usr/local/cuda}/lib64/stubs"
  [ -e "$stubs/libcuda.so" ] && export LIBRARY_PATH=$LIBRARY_PATH:$stubs
fi
python3 - <<'EOF' || exit 2
import torch, zero_offload
from zero_offload.kernels.host_adam import kernel_info
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
print("torch", torch.__version__, "| GPU", gpu, "| host Adam", kernel_info())
try:  # DeepSpeed's op builders compile a probe through distutils (Python 3.12: setuptools' copy)
    import distutils.ccompiler  # noqa: F401
except ImportError as e:
    print("no distutils (DeepSpeed's NVMe op cannot build):", e)
EOF
# A one-rank NCCL group, as every benchmark row makes: a broken one shows here, in seconds.
if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  RANK=0 WORLD_SIZE=1 MASTER_ADDR=127.0.0.1 MASTER_PORT=29555 timeout 120 python3 -c \
    "import torch.distributed as d; d.init_process_group('nccl'); d.barrier(); print('nccl ok')" \
    || echo "nccl: a one-rank group failed"
fi

status=0
parts=()
flush_parts() {
  if ((${#parts[@]})); then
    PYTHONPATH=/tmp/site_ds:$PYTHONPATH python3 benchmarks/gpu_suite.py --out "$out" --parts "${parts[@]}" ${SUITE_FLAGS:-} \
      >"$out/suite_stdout.md" 2>"$out/suite_stderr.log" || status=1
    cat "$out/suite_stdout.md"
    parts=()
  fi
}
for step in "$@"; do
  case "$step" in
    cuda-tests)
      flush_parts
      python3 -m pytest -q -p no:cacheprovider -rs -m cuda 2>&1 | tee "$out/cuda_tests.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      if grep -q "SKIPPED" "$out/cuda_tests.log"; then echo "CUDA tests skipped on a GPU machine"; status=1; fi
      ;;
    tests)
      flush_parts
      python3 -m pytest -q -p no:cacheprovider -n 8 --durations=15 2>&1 | tee "$out/tests.log" | tail -60
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    tests-on-gpu)
      flush_parts
      ZERO_OFFLOAD_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -n 8 2>&1 \
        | tee "$out/tests_on_gpu.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      ;;
    env | pcie | overlap | sizes | throughput | throughput_large | nvme) parts+=("$step") ;;
    *) echo "unknown step: $step"; exit 2 ;;
  esac
done
flush_parts
exit $status
