"""Item: the collective timeout defaults as DeepSpeed's does (``$DEEPSPEED_TIMEOUT`` minutes, else
10 minutes) on every route, and ``zero-offload launch --timeout`` overrides it on every route,
``deepspeed.init_distributed`` / ``deepspeed.initialize`` under the DeepSpeed names included."""

from __future__ import annotations

import datetime
import os
import time

import pytest
from distributed import _free_port, answer_of

_SMALL_MINUTES = "0.1"  # 6 s: start-up (both ranks forked together) fits well inside it


def _late_rank(rank: int, port: int, queue) -> None:
    """DeepSpeed's script shape: ``deepspeed.init_distributed()`` with no timeout, then a
    collective that rank 1 never enters (it is late for good)."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
        DEEPSPEED_TIMEOUT=_SMALL_MINUTES,
        ZERO_OFFLOAD_DEVICE="cpu",
    )
    os.environ.pop("ZERO_OFFLOAD_TIMEOUT", None)
    import torch

    from zero_offload import deepspeed_compat as deepspeed
    from zero_offload.core.dist import current_timeout

    seconds = None
    try:
        deepspeed.init_distributed()
        if rank == 1:
            time.sleep(3600)  # only the timeout can end rank 0's wait
        seconds = current_timeout().total_seconds()
        deepspeed.comm.all_reduce(torch.ones(4))
        queue.put((rank, f"finished (timeout {seconds} s)"))
    except Exception as e:  # noqa: BLE001 - the message is the result
        queue.put((rank, f"{seconds} s: {type(e).__name__}: {e}"))
    os._exit(0)


def test_deepspeed_timeout_bounds_the_wait_for_a_late_rank():
    # Without the variable honoured the group's timeout is 10 minutes or more: no answer within
    # the hang guard's limit.
    msg = answer_of(2, _late_rank, limit=180)
    assert msg.startswith("6.0 s: "), msg
    assert "timed out" in msg.lower() or "timeout" in msg.lower(), msg


@pytest.mark.parametrize(
    "env,seconds",
    [
        ({}, 600.0),  # DeepSpeed 0.19.6+'s default
        ({"DEEPSPEED_TIMEOUT": "3"}, 180.0),  # minutes, as DeepSpeed reads it
        ({"DEEPSPEED_TIMEOUT": "0.5"}, 30.0),  # fractional minutes: DeepSpeed refuses them
        ({"ZERO_OFFLOAD_TIMEOUT": "7", "DEEPSPEED_TIMEOUT": "3"}, 7.0),  # launch --timeout wins
    ],
)
def test_default_timeout_follows_deepspeed(monkeypatch, env, seconds):
    from zero_offload.core.dist import default_timeout

    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    monkeypatch.delenv("ZERO_OFFLOAD_TIMEOUT", raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert default_timeout() == datetime.timedelta(seconds=seconds)


@pytest.mark.parametrize("bad", ["0", "-1", "soon", "inf", "nan"])
def test_bad_deepspeed_timeout_names_the_variable(monkeypatch, bad):
    from zero_offload.core.dist import default_timeout

    monkeypatch.delenv("ZERO_OFFLOAD_TIMEOUT", raising=False)
    monkeypatch.setenv("DEEPSPEED_TIMEOUT", bad)
    with pytest.raises(ValueError, match=r"\$DEEPSPEED_TIMEOUT must be a positive number of min"):
        default_timeout()


def test_launcher_timeout_reaches_deepspeed_init_distributed(tmp_path, monkeypatch):
    """``ZERO_OFFLOAD_AS_DEEPSPEED=1``'s route: the script calls DeepSpeed's
    ``init_distributed`` (as ``deepspeed.initialize`` does) with no timeout; the launcher's
    ``--timeout`` is its group's timeout, over a ``DEEPSPEED_TIMEOUT`` in the environment."""
    from zero_offload.cli.main import main

    monkeypatch.setenv("DEEPSPEED_TIMEOUT", "3")
    monkeypatch.setenv("ZERO_OFFLOAD_DEVICE", "cpu")
    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys\n"
        "from zero_offload import deepspeed_compat as deepspeed\n"
        "from zero_offload.core.dist import current_timeout\n"
        "deepspeed.init_distributed()\n"
        "t = current_timeout().total_seconds()\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(str(t))\n"
    )
    argv = ["launch", "--num_gpus", "2", "--master_port", str(_free_port()), "--timeout", "42"]
    assert main([*argv, str(worker), str(tmp_path)]) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["42.0", "42.0"]
