"""From rank results to table rows: statistics, ratios against the anchors, and the text table."""

from __future__ import annotations

import statistics
from typing import Any

from _spec import Run, Shape

MIB = 2**20
GIB = 2**30


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); with fewer than 4 samples q1/q3 are the min/max."""
    if len(xs) < 4:
        return min(xs), statistics.median(xs), max(xs)
    q1, q2, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, q2, q3


def _split(acct: dict[str, int] | None) -> tuple[int, int] | None:
    if acct is None:
        return None
    dev = sum(v for k, v in acct.items() if k.startswith("device."))
    host = sum(v for k, v in acct.items() if k.startswith("host."))
    return dev, host


def merge_rounds(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One run measured in several rounds: timed steps pooled, peak RSS the largest, the rest
    (losses, accounting) from the first round. Any failed round makes the run failed."""
    failed = next((r for r in results if "error" in r), None)
    if failed is not None:
        return failed
    first = results[0]["ranks"]
    ranks = []
    for i, r0 in enumerate(first):
        rank = dict(r0)
        rank["wall"] = [x for res in results for x in res["ranks"][i]["wall"]]
        rank["cpu"] = [x for res in results for x in res["ranks"][i]["cpu"]]
        rank["peak_rss"] = max(res["ranks"][i]["peak_rss"] for res in results)
        ranks.append(rank)
    return {"ranks": ranks}


def summarize(shape: Shape, run: Run, result: dict[str, Any]) -> dict[str, Any]:
    """One row: the run, then either ``error`` or its measurements."""
    row: dict[str, Any] = {
        "run": run,
        "impl": run.impl,
        "stage": run.stage,
        "offload": run.mode,
        "world": run.world,
        "dtype": run.dtype,
    }
    if "error" in result:
        row["error"] = result["error"]
        return row
    ranks = result["ranks"]
    r0 = ranks[0]
    # A step ends when its slowest rank ends: per-step maximum over ranks, then statistics.
    wall = [max(r["wall"][i] for r in ranks) for i in range(len(r0["wall"]))]
    q1, med, q3 = _quantiles(wall)
    row.update(
        params=r0["params"],
        info=r0["info"],
        threads=r0["threads"],
        wall=wall,
        median_s=med,
        q1_s=q1,
        q3_s=q3,
        min_s=min(wall),
        max_s=max(wall),
        cpu_s=statistics.median(r0["cpu"]),
        tokens_per_s=shape.micro * shape.gas * shape.seq * run.world / med,
        peak_rss_mib=max(r["peak_rss"] for r in ranks) / MIB,
        rss_after_imports_mib=r0["rss_after_imports"] / MIB,
        live_mib=sum(r0["live"].values()) / MIB,
        losses=r0["losses"],
        accounted=r0["accounted"],
        expected=r0["expected"],
    )
    # Model TFLOPS per rank: 6N + attention FLOPs per token; "hw" adds the recomputed forward.
    per_rank = r0.get("flops_per_token", 0.0) * row["tokens_per_s"] / run.world / 1e12
    row["tflops"] = per_rank
    row["tflops_hw"] = per_rank * (4 / 3 if r0.get("recompute") else 1)
    row["init_s"] = r0.get("init_s")
    row["rss_steady_mib"] = max(r.get("rss_steady", 0) for r in ranks) / MIB
    if r0.get("cuda"):
        c = [r["cuda"] for r in ranks]
        row["gpu"] = r0["cuda"]["name"]
        row["gpu_total_gib"] = r0["cuda"]["total"] / GIB
        row["gpu_peak_init_gib"] = max(x["peak_init"]["reserved"] for x in c) / GIB
        row["gpu_peak_steps_gib"] = max(x["peak_steps"]["reserved"] for x in c) / GIB
        row["gpu_alloc_steps_gib"] = max(x["peak_steps"]["allocated"] for x in c) / GIB
    acct, want = _split(r0["accounted"]), _split(r0["expected"])
    row["accounted_mib"] = None if acct is None else (acct[0] / MIB, acct[1] / MIB)
    row["expected_mib"] = None if want is None else (want[0] / MIB, want[1] / MIB)
    return row


def _same_mode(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same stage, world, dtype, optimizer offload (and partial-offload ratio) and param offload
    (delayed update ignored)."""
    ra, rb = a["run"], b["run"]
    return (
        (a["world"], a["dtype"], a["stage"]) == (b["world"], b["dtype"], b["stage"])
        and ra.offload == rb.offload
        and ra.offload_param == rb.offload_param
        and ra.ratio == rb.ratio
    )


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Time ratios (> 1: slower than the anchor) vs plain PyTorch, vs DeepSpeed's same mode
    (same stage, optimizer and param offload on/off, world and dtype; the delayed update is
    compared with DeepSpeed's ordinary offload, which has no delayed update) and, at stage 3, vs
    FSDP2's same mode (no offload, or CPUOffloadPolicy for optimizer + param offload; FSDP2 has
    no optimizer-only offload)."""
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        key = (r["world"], r["dtype"])
        torch_row = next(
            (t for t in ok if t["impl"] == "torch" and (t["world"], t["dtype"]) == key), None
        )
        ds_row = next((d for d in ok if d["impl"] == "deepspeed" and _same_mode(d, r)), None)
        fsdp_row = next((f for f in ok if f["impl"] == "fsdp2" and _same_mode(f, r)), None)
        r["vs_torch"] = r["median_s"] / torch_row["median_s"] if torch_row else None
        r["vs_deepspeed"] = r["median_s"] / ds_row["median_s"] if ds_row else None
        r["vs_fsdp2"] = r["median_s"] / fsdp_row["median_s"] if fsdp_row else None


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _mib(x: float) -> str:
    return f"{x:.0f}" if x >= 10 or x == 0 else f"{x:.2f}"


def _pair(p: tuple[float, float] | None) -> str:
    return "-" if p is None else f"{_mib(p[0])}/{_mib(p[1])}"


HEADER = (
    "impl",
    "stage",
    "offload",
    "world",
    "dtype",
    "s/step",
    "IQR",
    "cpu s/step",
    "tokens/s",
    "x torch",
    "x DS",
    "x FSDP2",
    "peak RSS MiB",
    "live MiB",
    "acct dev/host MiB",
    "formula dev/host MiB",
    "loss",
)


GPU_HEADER = ("TFLOPS/GPU", "+recompute", "GPU peak GiB init/steps")


def table(rows: list[dict[str, Any]]) -> str:
    """The results as a Markdown table; a failed run shows its error in place of numbers. With a
    GPU, three more columns: model TFLOPS per GPU, the same with the recomputed forward, and the
    GPU's peak reserved memory while building and over the steps."""
    gpu = any("gpu" in r for r in rows)
    header = HEADER + GPU_HEADER if gpu else HEADER
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        head = [r["impl"], str(r["stage"]), r["offload"], str(r["world"]), r["dtype"]]
        if "error" in r:
            cells = head + [f"**error**: {r['error']}"] + [""] * (len(header) - len(head) - 1)
        else:
            cells = head + [
                f"{r['median_s']:.3f}",
                f"{r['q1_s']:.3f}-{r['q3_s']:.3f}",
                f"{r['cpu_s']:.3f}",
                f"{r['tokens_per_s']:.0f}",
                _f(r.get("vs_torch"), ".2f"),
                _f(r.get("vs_deepspeed"), ".2f"),
                _f(r.get("vs_fsdp2"), ".2f"),
                f"{r['peak_rss_mib']:.0f}",
                _mib(r["live_mib"]),
                _pair(r["accounted_mib"]),
                _pair(r["expected_mib"]),
                f"{r['losses'][-1]:.4f}",
            ]
            if gpu:
                cells += [
                    f"{r['tflops']:.1f}",
                    f"{r['tflops_hw']:.1f}",
                    f"{r['gpu_peak_init_gib']:.1f}/{r['gpu_peak_steps_gib']:.1f}"
                    if "gpu" in r
                    else "-",
                ]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)
