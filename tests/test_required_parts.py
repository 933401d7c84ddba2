"""CI's ``ZERO_OFFLOAD_TEST_REQUIRE``: a missing required part fails the run instead of
skipping its tests (tests/required_parts.py)."""

from __future__ import annotations

import pytest
import required_parts as rp


def _skip_report(reason: str) -> pytest.TestReport:
    return pytest.TestReport(
        "t.py::test", ("t.py", 1, "test"), {}, "skipped", ("t.py", 1, f"Skipped: {reason}"), "call"
    )


@pytest.mark.parametrize(
    "parts,reason,failed",
    [
        ("native", "zero_offload._aio did not build: ImportError", True),
        ("native", "compiled kernel unavailable: OSError", True),
        ("deepspeed", "deepspeed is not installed", True),
        ("deepspeed", "deepspeed does not import here: ...", True),
        ("native", "deepspeed is not installed", False),  # not required: stays a skip
        ("", "zero_offload._aio did not build", False),
        ("native,deepspeed", "no writable /dev/shm", False),  # not a missing part
    ],
)
def test_a_skip_for_a_required_part_fails(monkeypatch, parts, reason, failed):
    monkeypatch.setenv(rp.REQUIRE_ENV, parts)
    report = _skip_report(reason)
    rp.fail_required_skip(report)
    assert report.failed == failed and report.skipped != failed


def test_a_missing_required_part_stops_the_session(monkeypatch):
    monkeypatch.setenv(rp.REQUIRE_ENV, "native")
    rp.check_session()  # this checkout's compiled modules built
    monkeypatch.setattr(rp, "NATIVE", ("zero_offload._host_adam", "zero_offload._not_built"))
    with pytest.raises(pytest.UsageError, match="zero_offload._not_built"):
        rp.check_session()
    monkeypatch.setenv(rp.REQUIRE_ENV, "native,gpu")
    with pytest.raises(pytest.UsageError, match="unknown part"):
        rp.required()
