"""Build script for the optional C++ host Adam kernel (zero_offload._host_adam).

Project metadata lives in pyproject.toml; this file only declares the extension. The module is
a plain CPython C-API extension (no torch headers, no pybind11), so a wheel does not depend on
the torch ABI and nothing is JIT-compiled at the first optimizer step. It is built for the
baseline ISA (no -march=native): the AVX2 and AVX-512 variants are enabled per function with
target attributes and chosen at import time from the CPU's features. The extension is optional:
if it fails to build, the install still succeeds and zero_offload.kernels.host_adam falls back to
its pure-PyTorch reference implementation (with a warning).
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup

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
    ],
    depends=[
        os.path.join(CSRC, "host_adam.h"),
        os.path.join(CSRC, "scalar_math.h"),
        os.path.join(CSRC, "adam_body.inc"),
        os.path.join(CSRC, "thread_pool.h"),
        os.path.join(CSRC, "bandwidth_probe.h"),
    ],
    include_dirs=[CSRC],
    language="c++",
    extra_compile_args=extra_compile_args,
    extra_link_args=[] if sys.platform == "win32" else ["-pthread"],
    optional=True,
)

setup(ext_modules=[host_adam])
