"""Build script for the optional C++ extensions: the host Adam kernel (zero_offload._host_adam)
and the NVMe offload I/O engine (zero_offload._aio).

Project metadata lives in pyproject.toml; this file only declares the extensions. Both are
plain CPython C-API extensions (no torch headers, no pybind11), so a wheel does not depend on
the torch ABI and nothing is JIT-compiled at the first optimizer step. The kernel is built for the
baseline ISA (no -march=native): the AVX2 and AVX-512 variants are enabled per function with
target attributes and chosen at import time from the CPU's features. The extensions are optional:
if one fails to build, the install still succeeds and zero_offload.kernels.host_adam falls back to
its pure-PyTorch reference implementation, zero_offload.nvme.io.aio to a Python thread pool (each
with a warning).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# The DeepSpeed opt-in (README, "Hugging Face Trainer, Accelerate, TRL"): a .pth file at the top
# of site-packages, run by the interpreter at start-up. It imports zero_offload's hook only when
# ZERO_OFFLOAD_AS_DEEPSPEED is set to something other than a false value ("", 0, false, no, off:
# the hook's own list), so unset or off it costs one environment lookup and imports nothing; the
# hook turns the opt-in on for a true value and reports any other one.
PTH_NAME = "zero_offload_as_deepspeed.pth"
PTH_LINE = (
    "import os; os.environ.get('ZERO_OFFLOAD_AS_DEEPSPEED', '').strip().lower() not in "
    "('', '0', 'false', 'no', 'off') and __import__('zero_offload._as_deepspeed_hook')\n"
)


class build_py_with_pth(build_py):
    """A regular wheel (``pip install .``): the .pth at the root of the build, so at the root
    of site-packages once installed."""

    def run(self):
        super().run()
        if not getattr(self, "editable_mode", False):
            target = os.path.join(self.build_lib, PTH_NAME)
            with open(target, "w", encoding="utf-8") as f:
                f.write(PTH_LINE)
            self._pth_outputs = [target]

    def get_outputs(self, include_bytecode=True):
        return [*super().get_outputs(include_bytecode), *getattr(self, "_pth_outputs", [])]


cmdclass = {"build_py": build_py_with_pth}

try:  # an editable install (``pip install -e .``, PEP 660) writes its own wheel: add the .pth
    from setuptools.command.editable_wheel import editable_wheel

    class editable_wheel_with_pth(editable_wheel):
        def _select_strategy(self, name, tag, build_lib):
            strategy = super()._select_strategy(name, tag, build_lib)

            class WithPth:
                def __enter__(self):
                    strategy.__enter__()
                    return self

                def __exit__(self, *exc):
                    return strategy.__exit__(*exc)

                def __call__(self, wheel, files, mapping):
                    strategy(wheel, files, mapping)
                    wheel.writestr(PTH_NAME, PTH_LINE.encode("utf-8"))

            return WithPth()

    cmdclass["editable_wheel"] = editable_wheel_with_pth
except ImportError:  # setuptools < 64: no PEP 660 editable installs
    pass

CSRC = "src/zero_offload/csrc"

if sys.platform == "win32":
    extra_compile_args = ["/O2", "/std:c++17", "/fp:precise"]
else:
    extra_compile_args = [
        "-O3",
        "-std=c++17",
        "-fno-math-errno",
        # Never fuse a*b+c into fma (or split an fma): the SIMD bodies and the scalar tails must
        # perform the same IEEE operations so that results are bitwise independent of the ISA,
        # the thread count and where a tail starts.
        "-ffp-contract=off",
        "-fvisibility=hidden",
        "-Wall",
        "-Wextra",
        "-Wno-missing-field-initializers",
    ]

host_adam = Extension(
    "zero_offload._host_adam",
    sources=[
        os.path.join(CSRC, "host_adam.cpp"),
        os.path.join(CSRC, "kernels_scalar.cpp"),
        os.path.join(CSRC, "kernels_x86.cpp"),
        os.path.join(CSRC, "thread_pool.cpp"),
        os.path.join(CSRC, "bandwidth_probe.cpp"),
        os.path.join(CSRC, "sumsq.cpp"),
        os.path.join(CSRC, "quant_maps.cpp"),
        os.path.join(CSRC, "states_py.cpp"),
    ],
    depends=[
        os.path.join(CSRC, "host_adam.h"),
        os.path.join(CSRC, "scalar_math.h"),
        os.path.join(CSRC, "adam_body.inc"),
        os.path.join(CSRC, "thread_pool.h"),
        os.path.join(CSRC, "bandwidth_probe.h"),
        os.path.join(CSRC, "sumsq.h"),
        os.path.join(CSRC, "sumsq_body.inc"),
        os.path.join(CSRC, "adam_coeffs.h"),
        os.path.join(CSRC, "adam_states.h"),
        os.path.join(CSRC, "states_math.h"),
        os.path.join(CSRC, "states_body.inc"),
        os.path.join(CSRC, "states_select.inc"),
        os.path.join(CSRC, "states_py.h"),
    ],
    include_dirs=[CSRC],
    language="c++",
    extra_compile_args=extra_compile_args,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
    optional=True,
)

ext_modules = [host_adam]

# The NVMe offload I/O engine (zero_offload.nvme.io.aio): pread/pwrite on POSIX threads, outside the
# GIL. Optional like _host_adam: without it, zero_offload.nvme.io.aio runs the same requests on a
# Python thread pool (with a warning). POSIX only.
if sys.platform != "win32":
    ext_modules.append(
        Extension(
            "zero_offload._aio",
            sources=[os.path.join(CSRC, "aio.cpp")],
            include_dirs=[CSRC],
            language="c++",
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"],
            optional=True,
        )
    )

setup(ext_modules=ext_modules, cmdclass=cmdclass)
