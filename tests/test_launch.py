import argparse
import os
import socket
from pathlib import Path

import pytest
from torch.distributed.run import get_args_parser

from zero_offload.cli.launch.command import add_arguments, threads_per_rank, torchrun_argv


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("print('hi')\n")
    return str(path)


def test_deepspeed_flags_become_torchrun_flags(script: str) -> None:
    args = parse(
        ["--num_nodes", "2", "--num_gpus", "4", "--node_rank", "1", "--master_addr", "10.0.0.1"]
        + ["--master_port", "1234", script, "--deepspeed_config", "ds.json"]
    )
    argv = torchrun_argv(args, cuda_devices=8)
    # torchrun itself must read them as meant.
    ns = get_args_parser().parse_args(argv)
    assert (ns.nnodes, ns.nproc_per_node, ns.node_rank) == ("2", "4", 1)
    assert (ns.master_addr, ns.master_port, ns.module) == ("10.0.0.1", 1234, False)
    assert ns.training_script == script
    assert ns.training_script_args == ["--deepspeed_config", "ds.json"]


def test_script_flags_pass_through_untouched_even_when_they_look_like_ours(script: str) -> None:
    tail = ["--num_gpus", "7", "--master_port", "x", "-m", "--steps", "3"]
    args = parse(["--num_gpus", "2", script, *tail])
    assert args.num_gpus == 2
    argv = torchrun_argv(args, cuda_devices=0)
    assert argv[-len(tail) - 1 :] == [script, *tail]
    assert get_args_parser().parse_args(argv).training_script_args == tail


def test_num_gpus_defaults_to_the_cuda_devices_or_one(script: str) -> None:
    ns = get_args_parser().parse_args(torchrun_argv(parse([script]), cuda_devices=0))
    assert ns.nproc_per_node == "1"
    ns = get_args_parser().parse_args(torchrun_argv(parse([script]), cuda_devices=4))
    assert ns.nproc_per_node == "4"
    assert (ns.master_addr, ns.master_port) == ("127.0.0.1", 29500)


def test_cpu_only_allows_several_ranks(script: str) -> None:
    argv = torchrun_argv(parse(["--num_gpus", "3", script]), cuda_devices=0)
    assert get_args_parser().parse_args(argv).nproc_per_node == "3"


def test_module_runs_with_python_dash_m() -> None:
    args = parse(["--module", "zero_offload.cli.main", "train", "--steps", "2"])
    ns = get_args_parser().parse_args(torchrun_argv(args, cuda_devices=0))
    assert ns.module and ns.training_script == "zero_offload.cli.main"
    assert ns.training_script_args == ["train", "--steps", "2"]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--num_nodes", "0"], "--num_nodes"),
        (["--num_gpus", "0"], "--num_gpus"),
        (["--num_gpus", "3"], "--num_gpus 3"),  # more than the 2 devices below
        (["--num_nodes", "2", "--node_rank", "2", "--master_addr", "h"], "--node_rank"),
        (["--node_rank", "-1"], "--node_rank"),
        (["--master_port", "70000"], "--master_port"),
        (["--num_nodes", "2", "--node_rank", "1"], "--master_addr"),
    ],
)
def test_bad_values_name_the_flag(script: str, flags: list[str], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        torchrun_argv(parse([*flags, script]), cuda_devices=2)


def test_missing_script_is_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no_such.py.*--module"):
        torchrun_argv(parse([str(tmp_path / "no_such.py")]), cuda_devices=0)


def test_threads_are_shared_between_ranks() -> None:
    assert threads_per_rank(2, 16) == 8
    assert threads_per_rank(4, 2) == 1
    assert threads_per_rank(1, 2) == 2


def test_bad_value_is_an_error_exit_not_a_traceback(script: str, capsys) -> None:
    from zero_offload.cli.main import main

    assert main(["launch", "--num_gpus", "0", script]) == 2
    assert "--num_gpus must be at least 1" in capsys.readouterr().err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ranks_start_with_torchrun_env_and_failures_propagate(tmp_path: Path) -> None:
    from zero_offload.cli.main import main

    worker = tmp_path / "worker.py"
    worker.write_text(
        "import os, sys\n"
        "keys = ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_PORT', 'OMP_NUM_THREADS')\n"
        "values = ' '.join(os.environ[k] for k in keys)\n"
        "open(os.path.join(sys.argv[1], 'rank' + os.environ['RANK']), 'w').write(values)\n"
        "sys.exit(int(sys.argv[2]))\n"
    )
    omp = os.environ.get("OMP_NUM_THREADS")
    port = free_port()
    argv = ["launch", "--num_gpus", "2", "--master_port", str(port), str(worker)]
    assert main([*argv, str(tmp_path), "0"]) == 0
    seen = sorted((tmp_path / f"rank{r}").read_text().split()[:4] for r in (0, 1))
    assert seen == [["0", "0", "2", str(port)], ["1", "1", "2", str(port)]]
    assert main([*argv, str(tmp_path), "3"]) == 1
    assert "OMP_NUM_THREADS" not in os.environ or os.environ["OMP_NUM_THREADS"] == omp
