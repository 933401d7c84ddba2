"""The memory arithmetic by optimizer state format (fp32 states, DeepSpeed's bf16 states, 8-bit
moments): ``expected_bytes``, the step model's NVMe terms, the swap files' bytes and ``zero-offload
estimate``, each against a hand computation."""

from __future__ import annotations

import pytest
import torch

from zero_offload.cli.main import main
from zero_offload.config import load_config
from zero_offload.core.state.format import FP32, StateFormat
from zero_offload.runtime.plan.memory import expected_bytes
from zero_offload.runtime.plan.memory_model import ZeroPlan, states
from zero_offload.runtime.plan.state_bytes import mode_format, nvme_state_bytes, record_bytes
from zero_offload.runtime.update import state_build

N = 1 << 20  # params, a multiple of every block size
BF16 = StateFormat(master=torch.bfloat16, moments="bf16")
EIGHT = StateFormat(master=torch.bfloat16, moments="8bit", block=256)
SCALES = 2 * 4 / 256  # both moments' fp32 scales per param, block 256


def _host(out: dict[str, int]) -> float:
    return sum(v for k, v in out.items() if k.startswith("host.")) / N


@pytest.mark.parametrize(
    ("state", "want"),
    [
        # grad shard 2 + fp32 master 4 + moments 8 + 16-bit staging 2 (today's, measured)
        (FP32, {"master_shard": 4, "optimizer_state": 8, "grad_shard": 2, "param_staging": 2}),
        # DeepSpeed's: master 2 + grad 2 + moments 4; the bf16 master is the param: no staging
        (BF16, {"master_shard": 2, "optimizer_state": 4, "grad_shard": 2}),
        (EIGHT, {"master_shard": 2, "optimizer_state": 2 + SCALES, "grad_shard": 2}),
    ],
)
def test_stage_2_offload_host_bytes_per_param(state, want):
    out = expected_bytes(N, torch.bfloat16, 2, 1, True, state=state)
    assert {k.removeprefix("host."): v / N for k, v in out.items() if k.startswith("host.")} == want
    assert out["device.params"] == 2 * N
    assert _host(out) == {FP32: 16.0, BF16: 8.0, EIGHT: 6 + SCALES}[state]


@pytest.mark.parametrize(("state", "host"), [(FP32, 16.0), (BF16, 8.0), (EIGHT, 6 + SCALES)])
def test_stage_3_both_offloads_the_bf16_master_is_the_param_shard(state, host):
    # fp32 states: param shard 2 + master 4 + moments 8 + grad 2; a bf16 master beside the bf16
    # param shard in host memory is that shard (aliased, as fp32 training's is)
    out = expected_bytes(N, torch.bfloat16, 3, 1, True, offload_param=True, state=state)
    assert ("host.master_shard" in out) is (state == FP32)
    assert _host(out) == host


def test_device_states_and_fp32_master_with_8bit_moments():
    # stage 2 on the device, 4 ranks: params 2 + (grad 2 + master 2 + moments 4) / 4, the master
    # aliased to the bf16 params
    out = expected_bytes(N, torch.bfloat16, 2, 4, False, state=BF16)
    assert out == {"device.params": 2 * N, "device.grad_shard": N // 2, "device.optimizer_state": N}
    # fp16 training with 8-bit moments: an fp32 master (4), staged to the fp16 params (2)
    fp32_master = StateFormat(moments="8bit", block=64)
    out = expected_bytes(N, torch.float16, 1, 1, True, state=fp32_master)
    assert _host(out) == 4 + 2 + 2 * 4 / 64 + 2 + 2


def test_moment_scales_round_up_to_whole_blocks():
    assert record_bytes(300, EIGHT) == 300 * 2 + 2 * (300 + 2 * 4)  # two blocks of 256
    assert record_bytes(300, StateFormat(moments="8bit", block=32)) == 300 * 4 + 2 * (300 + 10 * 4)


@pytest.mark.parametrize("numel", [1, 2048, 1 << 22, (1 << 22) + 1, 3 << 23])
def test_nvme_state_bytes_fp32_is_the_swap_files_and_shrinks_by_format(numel):
    chunk = 1 << 22
    assert nvme_state_bytes(numel, chunk) == state_build.nvme_state_bytes(numel, chunk)
    chunks = max(1, -(-numel // chunk))
    assert nvme_state_bytes(numel, chunk, BF16) == 2 * chunks * chunk * 6
    assert nvme_state_bytes(numel, chunk, EIGHT) == 2 * chunks * (chunk * 4 + 2 * chunk // 256 * 4)


@pytest.mark.parametrize(("state", "record"), [(FP32, 12), (BF16, 6), (EIGHT, 4 + SCALES)])
def test_step_model_nvme_terms_by_format(state, record):
    plan = ZeroPlan(stage=3, dtype_bytes=2, optimizer="nvme", params="host", state=state)
    out = states(N, plan)
    assert (out["nvme.master_shard"] + out["nvme.optimizer_state"]) / N == record
    assert out["nvme.second_version"] / N == record  # both versions of every record
    chunk = min(plan.chunk, N)
    assert out["host.nvme_buffers"] == plan.optimizer_buffers * record * chunk
    assert "host.param_staging" not in out or state == FP32


def test_zero_plan_from_config_carries_the_format():
    cfg = load_config(
        {
            "train_batch_size": 1,
            "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
            "optimizer": {"type": "AdamW8bit", "params": {"block_size": 128}},
            "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
        }
    )
    plan = ZeroPlan.from_config(cfg, 1)
    assert plan.state == StateFormat(master=torch.bfloat16, moments="8bit", block=128)
    assert _host(states(N, plan)) == 2 + 2 + 2 + 2 * 4 / 128


def _host_column(capsys, *extra: str) -> float:
    assert main(["estimate", "--params", "1e9", "--stage", "2", *extra]) == 0
    out = capsys.readouterr().out
    row = [line.split() for line in out.splitlines() if line.split()[:2] == ["2", "cpu"]][0]
    return float(row[3])  # host per rank GB


def test_estimate_table_per_format(capsys):
    assert _host_column(capsys, "--dtype", "bf16") == 16.0
    assert _host_column(capsys, "--dtype", "bf16", "--states", "fp32") == 16.0
    assert _host_column(capsys, "--dtype", "bf16", "--states", "bf16") == 8.0
    assert _host_column(capsys, "--dtype", "bf16", "--states", "8bit") == 6.03  # 6 + 8/256
    # fp16: 8-bit moments beside an fp32 master and its staging: 4 + 2 + 2 + 2.03
    assert _host_column(capsys, "--states", "8bit") == 10.03


def test_estimate_bf16_states_need_bf16(capsys):
    assert main(["estimate", "--params", "1e9", "--states", "bf16"]) == 2
    assert "--dtype bf16" in capsys.readouterr().err


def _max_model_rows(capsys, *extra: str) -> dict[tuple[str, str], list[str]]:
    args = ["estimate", "--max-model", "--host-memory", "20", "--nvme-size", "100",
            "--stage", "2", "--seq-length", "512", *extra]  # fmt: skip
    assert main(args) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines()[2:]:
        cols = line.split()
        rows[(cols[1], cols[-1])] = cols
    return rows


def test_max_model_rows_per_format_for_cpu_and_nvme(capsys):
    rows = _max_model_rows(capsys, "--dtype", "bf16")
    assert set(rows) == {("none", "fp32")} | {
        (where, state) for where in ("cpu", "nvme") for state in ("fp32", "bf16", "8bit+bf16")
    }
    for where in ("cpu", "nvme"):  # fewer bytes per param: a larger model fits
        sizes = [float(rows[(where, s)][3]) for s in ("fp32", "bf16", "8bit+bf16")]
        assert sizes[0] < sizes[1] <= sizes[2]
    # the NVMe drive holds two versions of master + moments: 12 -> 6 -> 4 + 8/256 bytes/param
    for state, record in (("fp32", 12), ("bf16", 6), ("8bit+bf16", 4 + SCALES)):
        params, nvme = float(rows[("nvme", state)][3]), float(rows[("nvme", state)][8])
        assert nvme == pytest.approx(2 * record * params, rel=0.01)
    # fp16 training: no bf16 states, 8-bit moments beside an fp32 master
    assert {k[1] for k in _max_model_rows(capsys)} == {"fp32", "8bit"}
    # --states names one format
    assert {k[1] for k in _max_model_rows(capsys, "--dtype", "bf16", "--states", "bf16")} == {
        "bf16"
    }


def test_mode_format_names_its_allowed_values():
    assert mode_format("8bit", torch.float32).master == torch.float32
    with pytest.raises(ValueError, match="fp32, bf16, 8bit"):
        mode_format("int4", torch.bfloat16)
