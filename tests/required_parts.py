"""``ZERO_OFFLOAD_TEST_REQUIRE=native,deepspeed`` (CI sets it): the parts a test run must have.
Without it a test whose part is missing skips (a user's machine without a compiler or DeepSpeed
still runs the rest); with it the run fails instead: at start when a required part is missing,
and any test that skips for a required part's absence counts as failed. The library's own
fallback (a warning, then the pure-PyTorch path) is not changed by this.

- ``native``: the compiled modules ``zero_offload._host_adam`` and ``zero_offload._aio``;
- ``deepspeed``: an installed DeepSpeed, for the tests that compare with it."""

from __future__ import annotations

import importlib.machinery
import os

import pytest

REQUIRE_ENV = "ZERO_OFFLOAD_TEST_REQUIRE"
NATIVE = ("zero_offload._host_adam", "zero_offload._aio")
# What the skip reasons of the tests that need each part say (tests/test_aio.py,
# tests/test_host_adam.py; tests/test_config_compat.py, tests/test_schedulers.py).
SKIP_REASONS = {
    "native": ("did not build", "compiled kernel unavailable"),
    "deepspeed": (
        "deepspeed is not installed",
        "deepspeed is not importable",
        "deepspeed does not",
    ),
}


def required() -> set[str]:
    parts = {p.strip() for p in os.environ.get(REQUIRE_ENV, "").split(",") if p.strip()}
    unknown = parts - set(SKIP_REASONS)
    if unknown:
        raise pytest.UsageError(
            f"{REQUIRE_ENV}: unknown part(s) {sorted(unknown)}; allowed: {sorted(SKIP_REASONS)}"
        )
    return parts


def missing(parts: set[str]) -> list[str]:
    """The required parts this interpreter lacks, each with why."""
    out = []
    if "native" in parts:
        from zero_offload._native import load_optional

        for name in NATIVE:
            module, why = load_optional(name)
            if module is None:
                out.append(f"{name} ({why})")
    # PathFinder: the installed package, not the opt-in's stand-in (tests/test_as_deepspeed.py)
    if "deepspeed" in parts and importlib.machinery.PathFinder.find_spec("deepspeed") is None:
        out.append("deepspeed (not installed)")
    return out


def check_session() -> None:
    gone = missing(required())
    if gone:
        raise pytest.UsageError(f"{REQUIRE_ENV} requires what this run lacks: {', '.join(gone)}")


def fail_required_skip(report: pytest.TestReport) -> None:
    """A skip that says a required part is missing becomes a failure."""
    if not report.skipped:
        return
    reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else report.longrepr)
    for part in required():
        if any(s in reason.lower() for s in SKIP_REASONS[part]):
            report.outcome = "failed"
            report.longrepr = f"skipped, but {REQUIRE_ENV} requires {part}: {reason}"
            return
