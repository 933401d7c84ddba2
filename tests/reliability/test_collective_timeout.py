"""Item: a frozen rank makes the others fail after the configured timeout, naming the
collective and the step, instead of blocking for 30 minutes."""

from __future__ import annotations

import datetime
import os
import time

import pytest
from distributed import _free_port, answer_of, short_timeout_after_start_up

from zero_offload.core.dist import as_timeout


def _rank(rank: int, port: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE="2",
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE="2",
    )
    import reliability_helpers as h

    import zero_offload

    try:
        zero_offload.init_distributed(timeout=600)  # start-up: no race with a slow peer
        eng = h.engine(stage=2)
        short_timeout_after_start_up(10)  # the steps alone are timed
        for step in range(3):
            if rank == 1 and step == 2:
                time.sleep(3600)  # frozen for good: only the timeout can end the wait
            eng.backward(eng(h.batch()))
            eng.step()
        queue.put((rank, "finished"))
    except Exception as e:  # noqa: BLE001 - the message is the result
        queue.put((rank, f"{type(e).__name__}: {e}"))
    os._exit(0)  # the peer is gone or frozen: no orderly teardown to wait for


def test_frozen_rank_times_out_naming_collective_and_step():
    msg = answer_of(2, _rank)
    assert msg.startswith("CollectiveError"), msg
    assert "at engine step 2" in msg and "rank 0 of 2" in msg, msg
    assert any(f"collective {c}" in msg for c in ("reduce_scatter", "all_reduce")), msg


@pytest.mark.parametrize(
    "value,seconds",
    [(5, 5.0), (2.5, 2.5), ("7", 7.0), (datetime.timedelta(minutes=1), 60.0), (None, 600.0)],
)
def test_timeout_accepts_seconds_or_timedelta(monkeypatch, value, seconds):
    monkeypatch.delenv("DEEPSPEED_TIMEOUT", raising=False)
    monkeypatch.delenv("ZERO_OFFLOAD_TIMEOUT", raising=False)
    assert as_timeout(value).total_seconds() == seconds


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "soon", True, [1]])
def test_bad_timeout_is_an_error_naming_it(bad):
    with pytest.raises(ValueError, match="timeout"):
        as_timeout(bad)


def test_launcher_timeout_reaches_the_ranks(tmp_path):
    from zero_offload.cli.main import main

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys\n"
        "from zero_offload.core.dist import TIMEOUT_ENV, as_timeout\n"
        "t = as_timeout(os.environ[TIMEOUT_ENV]).total_seconds()\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(str(t))\n"
    )
    argv = ["launch", "--num_gpus", "2", "--master_port", str(_free_port()), "--timeout", "7"]
    assert main([*argv, str(worker), str(tmp_path)]) == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in (0, 1)] == ["7.0", "7.0"]
    assert "ZERO_OFFLOAD_TIMEOUT" not in os.environ


def test_launcher_rejects_a_bad_timeout(capsys):
    from zero_offload.cli.main import main

    assert main(["launch", "--timeout", "0", __file__]) == 2
    assert "--timeout: timeout must be a positive" in capsys.readouterr().err
