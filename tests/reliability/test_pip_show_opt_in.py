"""Issue: under ``ZERO_OFFLOAD_AS_DEEPSPEED=1`` ``pip show deepspeed`` crashed pip 23.2: the
opt-in's wrapper of ``search_packages_info`` required the ``include_files`` argument that only
later pips pass. The opt-in must never break pip, whatever its version."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
from typing import NamedTuple

import pytest

from zero_offload._as_deepspeed_pip import patch_pip_show


class _Info(NamedTuple):
    name: str
    version: str
    location: str
    summary: str
    files: list | None


def _fake_show_module(with_include_files: bool):
    """A ``pip._internal.commands.show`` of either shape: pip 23 (query only) or later."""

    class Module:
        _PackageInfo = _Info

    def old(query):
        return (_Info(q, "1", "here", "real", None) for q in query)

    def new(query, include_files):
        return (_Info(q, "1", "here", "real", [] if include_files else None) for q in query)

    Module.search_packages_info = staticmethod(new if with_include_files else old)
    return Module


@pytest.mark.parametrize("with_include_files", [False, True])
def test_pip_show_wrapper_takes_either_pip_signature(with_include_files):
    module = _fake_show_module(with_include_files)
    patch_pip_show(module)
    args = (True,) if with_include_files else ()
    found = list(module.search_packages_info(["deepspeed", "torch"], *args))
    assert [i.name for i in found] == ["torch", "deepspeed"]
    assert "zero.offload" in found[1].version
    if with_include_files:
        found = list(module.search_packages_info(["torch"], include_files=False))
        assert found[0].files is None


def test_pip_show_wrapper_falls_back_to_pip_when_its_answer_fails(monkeypatch):
    import zero_offload._as_deepspeed_pip as pip_patch

    def broken(*_a, **_k):
        raise RuntimeError("boom")

    module = _fake_show_module(False)
    patch_pip_show(module)
    monkeypatch.setattr(pip_patch, "_compat_info", broken)
    found = list(module.search_packages_info(["deepspeed"]))
    assert [(i.name, i.summary) for i in found] == [("deepspeed", "real")]


def _bundled_pip23():
    import ensurepip

    wheels = glob.glob(os.path.join(os.path.dirname(ensurepip.__file__), "_bundled", "pip-*.whl"))
    return wheels[0] if wheels else None


def test_pip_show_deepspeed_with_the_interpreters_bundled_pip():
    """The interpreter's own bundled pip (23.2 on Python 3.11), run from its wheel."""
    wheel = _bundled_pip23()
    if wheel is None:
        pytest.skip("this interpreter bundles no pip wheel")
    env = dict(os.environ, ZERO_OFFLOAD_AS_DEEPSPEED="1")
    cmd = [sys.executable, os.path.join(wheel, "pip"), "show", "deepspeed"]
    cmd.append("--disable-pip-version-check")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    fields = dict(ln.split(": ", 1) for ln in proc.stdout.splitlines() if ": " in ln)
    assert fields["Name"] == "deepspeed" and "zero.offload" in fields["Version"]
