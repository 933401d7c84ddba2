"""Where the tests run: every test not marked ``cuda`` runs on the CPU, also on a machine with a
GPU (they compare against CPU references and feed CPU tensors; the ``cuda`` tests cover the GPU
paths). On such a machine a CPU test also sees no GPU (``cuda_visibility.hide_cuda``), so that libraries which
pick their own device (transformers, accelerate) pick the CPU the engine runs on.
``ZERO_OFFLOAD_TEST_DEVICE=cuda`` runs them all on the GPU instead, to find what is not
device-agnostic."""

from __future__ import annotations

import os

import pytest
from cuda_visibility import hide_cuda


@pytest.fixture(autouse=True)
def _device(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.node.get_closest_marker("cuda") is not None:
        return
    if os.environ.get("ZERO_OFFLOAD_TEST_DEVICE", "cpu") == "cpu":
        monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", "cpu")
        hide_cuda(monkeypatch)


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A default process group a test made in this process (``deepspeed.initialize`` makes a
    group of one without a launcher, as DeepSpeed does) is destroyed after it, so the next test
    starts from the state it would see alone."""
    import torch.distributed as dist

    before = dist.is_available() and dist.is_initialized()
    yield
    if not before and dist.is_available() and dist.is_initialized():
        from zero_offload.core.dist import shutdown

        shutdown()


@pytest.fixture
def one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment of a one-rank process group, on a port of this process's own
    (``pytestmark = pytest.mark.usefixtures("one_rank")``)."""
    env = {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 2000))


def pytest_sessionstart(session: pytest.Session) -> None:
    from required_parts import check_session

    check_session()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    from required_parts import fail_required_skip

    outcome = yield
    fail_required_skip(outcome.get_result())
