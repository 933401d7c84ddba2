"""benchmarks/pcie_bandwidth.py without a GPU: sizes, medians and GB/s, the table, and the
"needs CUDA" exit that the suite runner reads as skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import _bandwidth as bw  # noqa: E402
import pcie_bandwidth  # noqa: E402

MiB, GiB = 2**20, 2**30


@pytest.mark.parametrize(
    "text,n",
    [
        ("4096", 4096),
        ("64K", 64 * 1024),
        ("64KiB", 64 * 1024),
        ("1MiB", MiB),
        ("1mib", MiB),
        ("1.5KiB", 1536),
        ("2G", 2 * GiB),
        ("1GiB", GiB),
        ("10MB", 10_000_000),
        ("3 KB", 3000),
    ],
)
def test_parse_size(text, n):
    assert bw.parse_size(text) == n


@pytest.mark.parametrize("text", ["", "abc", "1XB", "0", "0.5", "1.3B", "-1MiB", "MiB"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        bw.parse_size(text)


def test_format_size():
    assert [bw.format_size(n) for n in (GiB, 256 * MiB, 4096, 1000, 3 * MiB // 2)] == [
        "1 GiB",
        "256 MiB",
        "4 KiB",
        "1000 B",
        "1536 KiB",
    ]


def test_size_range():
    sizes = bw.size_range(MiB, GiB)
    assert len(sizes) == 11 and sizes[0] == MiB and sizes[-1] == GiB
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert bw.size_range(MiB, 3 * MiB) == [MiB, 2 * MiB, 3 * MiB]
    assert bw.size_range(MiB, MiB) == [MiB]
    with pytest.raises(ValueError):
        bw.size_range(2 * MiB, MiB)


def test_gbps_and_bytes_moved():
    assert bw.gbps(1e9, 1.0) == pytest.approx(1.0)
    assert bw.gbps(GiB, 0.1) == pytest.approx(GiB / 1e8)
    assert bw.moved_bytes("bidir_pinned", 100) == 200
    assert bw.moved_bytes("h2d_pageable", 100) == 100


def fake_times(kind: str, size: int) -> list[float]:
    """Repeats at t, 3t, 2t with t = size at 10 GB/s: median 2t, so 5 GB/s one way and 10 GB/s
    both ways (twice the bytes in the same time)."""
    t = size / 10e9
    return [t, 3 * t, 2 * t]


def test_measure_and_summarize_with_a_fake_timer():
    raw = bw.measure([MiB, 4 * MiB], bw.KINDS, fake_times)
    assert set(raw) == set(bw.KINDS) and set(raw["h2d_pinned"]) == {MiB, 4 * MiB}
    s = bw.summarize(raw)
    one = s["kinds"]["h2d_pinned"][MiB]
    assert one["median_s"] == pytest.approx(2 * MiB / 10e9)
    assert one["gbps"] == pytest.approx(5.0)
    assert one["repeats"] == 3 and one["min_s"] < one["median_s"] < one["max_s"]
    assert s["kinds"]["bidir_pinned"][4 * MiB]["gbps"] == pytest.approx(10.0)
    assert s["kinds"]["bidir_pinned"][4 * MiB]["bytes"] == 8 * MiB
    assert s["peak_gbps"] == pytest.approx(
        {k: (10.0 if k == "bidir_pinned" else 5.0) for k in bw.KINDS}
    )
    with pytest.raises(ValueError):
        bw.measure([MiB], ["sideways"], fake_times)


def test_table():
    s = bw.summarize(bw.measure([MiB, GiB], ["h2d_pinned", "bidir_pinned"], fake_times))
    lines = bw.table(s).splitlines()
    assert lines[0] == "| size | H2D pinned GB/s | both ways pinned (sum) GB/s |"
    assert lines[1] == "|---|---|---|"
    assert lines[2] == "| 1 MiB | 5.0 | 10.0 |"
    assert lines[3] == "| 1 GiB | 5.0 | 10.0 |"
    assert lines[4] == "| **peak** | **5.0** | **10.0** |"
    json.dumps(s)  # the JSON the script writes


def test_arguments():
    args = pcie_bandwidth.parse_args(["--min", "1MiB", "--max", "8MiB", "--kinds", "h2d_pinned"])
    assert args.sizes == [MiB, 2 * MiB, 4 * MiB, 8 * MiB] and args.kinds == ["h2d_pinned"]
    assert pcie_bandwidth.parse_args([]).sizes == bw.size_range(MiB, GiB)
    for bad in (["--min", "2MiB", "--max", "1MiB"], ["--repeats", "0"], ["--min", "lots"]):
        with pytest.raises(SystemExit):
            pcie_bandwidth.parse_args(bad)


def test_without_cuda_it_says_so_and_writes_skipped(tmp_path):
    out = tmp_path / "pcie.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "pcie_bandwidth.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [json.loads(out.read_text())["skipped"]]
    assert "needs CUDA" in done.stdout


@pytest.mark.parametrize("kind", bw.KINDS)
def test_copies_for_each_kind_move_the_right_bytes(kind):
    import torch

    buffers = pcie_bandwidth.Buffers(64, [kind], torch.device("cpu"))
    copies = pcie_bandwidth.copies_for(kind, 16, buffers, "s1", "s2")
    assert [s for s, _ in copies] == (["s1", "s2"] if kind.startswith("bidir") else ["s1"])
    for _, fn in copies:
        fn()
    h_dst = buffers.host[kind.split("_")[1]][1]
    to_device = int(buffers.dev_dst.sum()) == 16
    to_host = int(h_dst.sum()) == 16
    assert (to_device, to_host) == {"h2d": (True, False), "d2h": (False, True)}.get(
        kind.split("_")[0], (True, True)
    )
    assert int(buffers.dev_dst[16:].sum()) == 0 and int(h_dst[16:].sum()) == 0  # only the slice
