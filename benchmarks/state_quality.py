"""Compact optimizer states: what they cost in loss, on the main job (docs/benchmarks.md).

Runs ``zero-offload train`` (the built-in corpus, a GPT-2 of the default preset's depth) once per
state mode, same seed, data and schedule, stage 2 + ``offload_optimizer`` "cpu", bf16 training:

* ``fp32``: fp32 master and moments (the default; the reference);
* ``bf16``: bf16 master + bf16 moments, round to nearest even (DeepSpeed's
  ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states``);
* ``bf16-master``: bf16 master, fp32 moments, round to nearest even;
* ``bf16+sr``: bf16 master + bf16 moments, the master written with stochastic rounding
  (``bf16.stochastic_rounding``);
* ``bf16-master+sr``: bf16 master with stochastic rounding, fp32 moments;
* ``8bit+bf16``: ``AdamW8bit`` with a bf16 master (6 B/param), round to nearest even;
* ``8bit+bf16+sr``: the same, the master written with stochastic rounding;
* ``8bit``: ``AdamW8bit`` with an fp32 master.

Each run is the train command itself, in a worker process that adds a read-only probe: every
``--probe-every`` steps it reads each group's master before and after ``engine.step()`` and the
moments after it, recomputes the fp32 AdamW update of every element from them
(``lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * w)``), and counts the elements whose
master did not change although that update is nonzero (the update a bf16 master dropped), the
elements whose update is below half a bf16 ulp of the weight (what round-to-nearest drops), and
how much of those sub-half-ulp updates' mass the master took along their sign (round to nearest:
about none; stochastic rounding: all, in expectation). Each run's ``probe.json`` keeps the
sampled steps' counts (also the L1 mass of the updates on unchanged elements).

Prints one table (final loss = mean of the last 20 steps' train loss, held-out loss, the gap of
each to ``fp32``, host bytes per param from ``engine.memory_report()``, the probe's fractions)
and writes one plot: every mode's train loss (raw and running mean, as the job's loss.png) and,
below, each mode's loss against fp32 states' at the same step (the same batch), in percent::

    python benchmarks/state_quality.py [--steps 600] [--modes fp32,bf16,...] [--jobs 8]
        [--plot docs/state_quality.png] [--out runs/state_quality]
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from typing import Any

# name -> (bf16 block beyond "enabled", optimizer type)
MODES: dict[str, tuple[dict[str, bool], str]] = {
    "fp32": ({}, "AdamW"),
    "bf16": ({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}, "AdamW"),
    "bf16-master": ({"bf16_master_weights_and_grads": True}, "AdamW"),
    "bf16+sr": (
        {
            "bf16_master_weights_and_grads": True,
            "bf16_optimizer_states": True,
            "stochastic_rounding": True,
        },
        "AdamW",
    ),
    "bf16-master+sr": (
        {"bf16_master_weights_and_grads": True, "stochastic_rounding": True},
        "AdamW",
    ),
    "8bit+bf16": ({"bf16_master_weights_and_grads": True}, "AdamW8bit"),
    "8bit+bf16+sr": (
        {"bf16_master_weights_and_grads": True, "stochastic_rounding": True},
        "AdamW8bit",
    ),
    "8bit": ({}, "AdamW8bit"),
}
REFERENCE = "fp32"
TAIL = 20  # final loss: mean of the last TAIL steps' train loss
SEED = 1234
# The main job's model at its default depth, narrower and shorter so that a run of several
# hundred bf16 steps fits minutes on two CPU cores.
MODEL_ARGS = ["--hidden-size", "128", "--num-attention-heads", "4", "--seq-length", "64"]


def mode_config(name: str, steps: int, seed: int = SEED) -> dict[str, Any]:
    """The main job's built-in config with bf16 training and the mode's states."""
    from zero_offload.cli.train.command import resolve_config

    config, _, _ = resolve_config(None, steps)
    extra, opt_type = MODES[name]
    config["bf16"] = {"enabled": True, **extra}
    config["optimizer"]["type"] = opt_type
    config["seed"] = seed  # seeds torch at initialize and the stochastic rounding
    return config


# ---- the worker: the train command with the probe ---------------------------------------------


def _half_ulp_bf16(w: Any) -> Any:
    """Half a bf16 ulp of each value of ``w`` (fp32 tensor of bf16-representable values)."""
    import torch

    _, exp = torch.frexp(w)  # |w| = mant * 2**exp, mant in [0.5, 1)
    half = torch.ldexp(torch.ones_like(w), exp - 9)  # ulp = 2**(exp - 8)
    return torch.where(w == 0, torch.zeros_like(w), half)


class DropProbe:
    """Wraps ``engine.step``: on sampled steps, the elements whose master did not move although
    the fp32 AdamW update is nonzero. Reads state only: the run's numbers are unchanged."""

    def __init__(self, engine: Any, every: int) -> None:
        self.engine, self.every, self.rows = engine, every, []
        self._step = engine.step
        engine.step = self.step

    def _masters(self) -> list[Any]:
        out = []
        for og in self.engine.opt_groups:
            st = og.state
            out.append(st.read("master", 0, st.numel).float().clone())
        return out

    def step(self, *args: Any, **kwargs: Any) -> Any:
        e = self.engine
        done = e.global_steps
        if not (e.is_gradient_accumulation_boundary() and (done + 1) % self.every == 0):
            return self._step(*args, **kwargs)
        before = self._masters()
        hyper = [dict(e.optimizer.param_groups[og.index]) for og in e.opt_groups]
        out = self._step(*args, **kwargs)
        if e.global_steps == done + 1:  # not skipped
            self._measure(done + 1, before, hyper)
        return out

    def _measure(self, t: int, before: list[Any], hyper: list[dict[str, Any]]) -> None:
        row = {"step": t, "lr": hyper[0]["lr"], "numel": 0, "nonzero": 0, "unchanged": 0,
               "below_half": 0, "mass": 0.0, "mass_unchanged": 0.0, "small_mass": 0.0,
               "small_applied": 0.0}  # fmt: skip
        for og, w0, h in zip(self.engine.opt_groups, before, hyper, strict=True):
            st = og.state
            w1 = st.read("master", 0, st.numel).float()
            m = st.read("exp_avg", 0, st.numel).float()
            v = st.read("exp_avg_sq", 0, st.numel).float()
            b1, b2 = h["betas"]
            lr, eps, wd = h["lr"], h["eps"], h.get("weight_decay", 0.0)
            upd = lr * ((m / (1 - b1**t)) / ((v / (1 - b2**t)).sqrt() + eps) + wd * w0)
            nonzero = upd != 0
            unchanged = nonzero & (w1 == w0)
            below = nonzero & (upd.abs() < _half_ulp_bf16(w0))
            a = upd.abs().double()
            row["numel"] += st.numel
            row["nonzero"] += int(nonzero.sum())
            row["unchanged"] += int(unchanged.sum())
            row["below_half"] += int(below.sum())
            row["mass"] += float(a.sum())
            row["mass_unchanged"] += float(a[unchanged].sum())
            # the sub-half-ulp updates: how much of them the master took, along their sign
            # (round to nearest: none; stochastic rounding: all, in expectation; fp32: all)
            moved = ((w0 - w1) * upd.sign()).double()
            row["small_mass"] += float(a[below].sum())
            row["small_applied"] += float(moved[below].sum())
        self.rows.append(row)


def worker(
    mode: str, out: str, steps: int, seed: int, probe_every: int, train_args: list[str]
) -> int:
    import zero_offload
    from zero_offload.cli.main import main as cli_main

    os.makedirs(out, exist_ok=True)
    cfg_path = os.path.join(out, "ds_config.json")
    with open(cfg_path, "w") as f:
        json.dump(mode_config(mode, steps, seed), f, indent=1)
    probes: list[DropProbe] = []
    initialize = zero_offload.initialize

    def probed(*args: Any, **kwargs: Any):
        result = initialize(*args, **kwargs)
        probes.append(DropProbe(result[0], probe_every))
        return result

    zero_offload.initialize = probed
    argv = ["train", "--config", cfg_path, "--steps", str(steps), "--out", out,
            "--seed", str(seed), "--log-every", "100", *train_args]  # fmt: skip
    rc = cli_main(argv)
    with open(os.path.join(out, "probe.json"), "w") as f:
        json.dump(probes[0].rows if probes else [], f)
    return rc


# ---- the parent: runs, table, plot ------------------------------------------------------------


def _launch(args: argparse.Namespace, modes: list[str]) -> dict[str, int]:
    """Every mode's worker, at most ``--jobs`` at a time; the exit status of each."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    pending, running, status = list(modes), {}, {}
    while pending or running:
        while pending and len(running) < args.jobs:
            mode = pending.pop(0)
            out = os.path.join(args.out, mode)
            os.makedirs(out, exist_ok=True)
            cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--out", out,
                   "--steps", str(args.steps), "--seed", str(args.seed),
                   "--probe-every", str(args.probe_every),
                   "--", *args.train_args]  # fmt: skip
            log = open(os.path.join(out, "log.txt"), "w")
            running[mode] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                log,
            )
            print(f"started {mode}: {' '.join(cmd)}", flush=True)
        for mode, (proc, log) in list(running.items()):
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                continue
            log.close()
            status[mode] = proc.returncode
            del running[mode]
            print(f"finished {mode}: exit {proc.returncode}", flush=True)
    return status


def _losses(folder: str) -> tuple[list[int], list[float]]:
    with open(os.path.join(folder, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    return [int(r["step"]) for r in rows], [float(r["loss"]) for r in rows]


def _summary(folder: str) -> dict[str, Any]:
    steps, losses = _losses(folder)
    with open(os.path.join(folder, "run.json")) as f:
        run = json.load(f)
    host = sum(v for k, v in run["memory"].items() if k.startswith("host."))
    with open(os.path.join(folder, "probe.json")) as f:
        probe = json.load(f)
    late = probe[len(probe) * 3 // 4 :]  # the last quarter: the decayed learning rate

    def frac(rows: list[dict[str, Any]], key: str, of: str) -> float:
        total = sum(r[of] for r in rows)
        return sum(r[key] for r in rows) / total if total else math.nan

    tail = losses[-TAIL:]
    return {
        "steps": steps,
        "losses": losses,
        "final": sum(tail) / len(tail),
        "heldout": run["heldout_loss"],
        "bytes": host / run["num_parameters"],
        "unchanged": frac(probe, "unchanged", "nonzero"),
        "unchanged_late": frac(late, "unchanged", "nonzero"),
        "below_half": frac(probe, "below_half", "nonzero"),
        "mass_dropped": frac(probe, "mass_unchanged", "mass"),
        "below_half_late": frac(late, "below_half", "nonzero"),
        "small_applied": frac(probe, "small_applied", "small_mass"),
        "small_applied_late": frac(late, "small_applied", "small_mass"),
        "params": run["num_parameters"],
        "model": run["model"],
        "seconds": run["seconds"],
    }


def _table(results: dict[str, dict[str, Any]]) -> str:
    ref = results.get(REFERENCE)
    head = ("| mode | host B/param | final loss (last 20 steps) | gap to fp32 | held-out loss | gap "
            "to fp32 | update < half a bf16 ulp of its weight (all / last quarter) | master "
            "unchanged though the update is nonzero (all / last quarter) | of the sub-half-ulp "
            "updates' mass, applied (all / last quarter) |")  # fmt: skip
    lines = [head, "| " + " | ".join(["---"] * 9) + " |"]

    def pair(r: dict[str, Any], key: str) -> str:
        return f"{100 * r[key]:.1f}% / {100 * r[key + '_late']:.1f}%"

    for mode, r in results.items():
        gap = gap_h = "-"
        if ref is not None and mode != REFERENCE:
            gap = f"{100 * (r['final'] / ref['final'] - 1):+.2f}%"
            gap_h = f"{100 * (r['heldout'] / ref['heldout'] - 1):+.2f}%"
        lines.append(
            f"| {mode} | {r['bytes']:.2f} | {r['final']:.4f} | {gap} | {r['heldout']:.4f} | "
            f"{gap_h} | {pair(r, 'below_half')} | {pair(r, 'unchanged')} | "
            f"{pair(r, 'small_applied')} |"
        )
    return "\n".join(lines)


def _running_mean(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, j - window + 1) : j + 1]) / (j + 1 - max(0, j - window + 1))
        for j in range(len(values))
    ]


def _plot(results: dict[str, dict[str, Any]], path: str, title: str) -> None:
    """The main job's loss.png style (thin raw curve, bold running mean), one color per mode;
    below, each mode's loss against fp32 states' at the same step (same batch), in percent."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_gap) = plt.subplots(2, 1, figsize=(7, 7), gridspec_kw={"height_ratios": [3, 2]})
    ref = results.get(REFERENCE)
    for i, (mode, r) in enumerate(results.items()):
        steps, losses = r["steps"], r["losses"]
        window = max(1, len(losses) // 30)
        color = f"C{i}"
        ax.plot(steps, losses, lw=0.6, alpha=0.15, color=color)
        label = f"{mode} ({r['bytes']:.1f} B/param): {r['final']:.3f}"
        ax.plot(steps, _running_mean(losses, window), lw=1.3, color=color, label=label)
        if ref is not None:
            rel = [100 * (a / b - 1) for a, b in zip(losses, ref["losses"], strict=True)]
            ax_gap.plot(steps, _running_mean(rel, window), lw=1.3, color=color)
    ax.set_ylabel("train loss (nats/byte)")
    ax.set_title(title, fontsize=8)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, title=f"mode (host state): mean of last {TAIL}", title_fontsize=8)
    ax_gap.axhline(1.0, color="grey", ls="--", lw=0.8)
    ax_gap.set_ylabel(f"loss vs {REFERENCE} states, same step (%)")
    ax_gap.set_xlabel("step")
    ax_gap.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated: {', '.join(MODES)}")
    p.add_argument("--jobs", type=int, default=len(MODES), help="runs at a time")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each run")
    p.add_argument(
        "--seed", type=int, default=SEED, help="model init, data order, stochastic rounding"
    )
    p.add_argument("--probe-every", type=int, default=10, help="probe every N steps")
    p.add_argument("--out", default=os.path.join("runs", "state_quality"))
    p.add_argument("--plot", default=None, help="PNG path (default: <out>/state_quality.png)")
    p.add_argument("--report-only", action="store_true", help="table and plot of existing runs")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("train_args", nargs="*", help="after --: more train arguments")
    args = p.parse_args()
    if not args.train_args:
        args.train_args = list(MODEL_ARGS) + ["--eval-batches", "64"]
    if args.worker:
        return worker(
            args.worker, args.out, args.steps, args.seed, args.probe_every, args.train_args
        )
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {list(MODES)}")
    if not args.report_only:
        status = _launch(args, modes)
        for mode, rc in status.items():
            if rc != 0:
                print(f"{mode}: exit {rc}; see {os.path.join(args.out, mode, 'log.txt')}")
        modes = [m for m in modes if status.get(m) == 0]
    results = {m: _summary(os.path.join(args.out, m)) for m in modes}
    if not results:
        return 1
    any_r = next(iter(results.values()))
    m = any_r["model"]
    title = (f"zero-offload train: GPT-2 {m['num_layers']}x{m['hidden_size']}, seq {m['seq_length']} "
             f"({any_r['params'] / 1e6:.2f}M params), bf16,\nstage 2 + offload \"cpu\", "
             f"{len(any_r['steps'])} steps, seed {args.seed}")  # fmt: skip
    print(title)
    print(_table(results))
    plot = args.plot or os.path.join(args.out, "state_quality.png")
    _plot(results, plot, title)
    print(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
