"""The GPU check's steps (``scripts/gpu_check.py``), figures first: the install and its smoke
test, then the measurements (PCIe, throughput, ZenFlow at stages 2 and 3, overlap), then the
CUDA tests, probes and sanitizer cases; each with its own time limit (all of them together
within the GPU cap, ``CAP_S``) and the log in OUTDIR that holds its details. Without CUDA (the CPU
rehearsal) every step still runs its wiring: the CUDA test steps collect their tests, the
benchmarks run a tiny CPU shape, and those steps are reported skipped unless the wiring fails.
``cpu_suite`` runs only when named (CI runs the CPU suite; a lease has no minutes for it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

PROBES = "tests/cuda_probes"  # GPU-only probes of known defects (marked cuda)
SANITIZER = "tests/cuda_sanitizer"  # parity cases under TORCH_CUDA_SANITIZER=1
# The CPU suite's stand-in for the rehearsal: a few quick files, enough to prove the wiring.
REHEARSAL_TESTS = ("tests/test_window.py", "tests/test_placement.py")
# A ~1.3B GPT (GPT-3 XL's shape: 24 x 2048, 16 heads) for the throughput row.
GPT_1_3B = ["--layers", "24", "--hidden", "2048", "--heads", "16", "--seq", "1024"]
TINY_GPT = ["--layers", "1", "--hidden", "32", "--heads", "2", "--seq", "16"]


@dataclass
class Ctx:
    """What the steps' commands depend on."""

    python: str
    repo: Path
    scratch: Path  # data files of the steps (packed into OUTDIR/data.tgz)
    cuda: bool
    xdist: bool  # pytest-xdist importable
    timeout_plugin: bool  # pytest-timeout importable
    install: bool = False  # the rehearsal installs for real (scripts/gpu_rehearse.sh), not --check


@dataclass
class Step:
    name: str
    log: str  # its details file in OUTDIR
    budget: float | None  # seconds at most; None: what the check has left
    cuda: bool  # the rehearsal runs only its wiring and reports it skipped
    command: Callable[[Ctx], list[str] | None]  # None: nothing to run here (skipped)
    env: dict[str, str] = field(default_factory=dict)
    skipped_ok: bool = True  # False: a skipped test fails the step (on a GPU)
    data: tuple[str, ...] = ()  # what it leaves under scratch
    default: bool = True  # False: runs only when named (--steps)


def pytest(ctx: Ctx, per_test: int, workers: int, *args: str) -> list[str]:
    """pytest with a per-test limit (pytest-timeout) and, on the GPU, xdist workers. Alone, the
    limit interrupts the test (pytest still reports the rest); a hang the interrupt cannot reach
    runs into the step's own limit."""
    cmd = [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs"]
    parallel = ctx.xdist and workers > 1
    if ctx.timeout_plugin:
        cmd += ["--timeout", str(per_test)]
        if parallel:  # a test hung in a CUDA call ends its worker, which xdist replaces
            cmd += ["--timeout-method", "thread"]
    if parallel:
        cmd += ["-n", str(workers)]
    return cmd + list(args)


def cuda_test_files(repo: Path) -> list[str]:
    """The test files outside the probes and the sanitizer cases that mark tests ``cuda``
    (collecting only these, not the whole suite, saves every xdist worker the suite's imports)."""
    skip = (repo / PROBES, repo / SANITIZER)
    return [
        str(f.relative_to(repo))
        for f in sorted((repo / "tests").rglob("test_*.py"))
        if not any(d in f.parents for d in skip) and "pytest.mark.cuda" in f.read_text()
    ]


def _cuda_tests(ctx: Ctx) -> list[str]:
    sel = ["-m", "cuda", *cuda_test_files(ctx.repo)]
    if not ctx.cuda:
        return [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", *sel]
    return pytest(ctx, 60, 4, *sel)


def _folder(path: str, per_test: int) -> Callable[[Ctx], list[str] | None]:
    def command(ctx: Ctx) -> list[str] | None:
        if not any((ctx.repo / path).glob("test_*.py")):
            return None
        if not ctx.cuda:
            return [ctx.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                    "-m", "cuda", path]  # fmt: skip
        return pytest(ctx, per_test, 1, "-m", "cuda", path)

    return command


def _pcie(ctx: Ctx) -> list[str]:
    out = str(ctx.scratch / "pcie.json")
    return [ctx.python, "benchmarks/pcie_bandwidth.py", "--max", "256MiB", "--repeats", "5",
            "--json", out]  # fmt: skip


def _overlap(ctx: Ctx) -> list[str]:
    cmd = [ctx.python, "benchmarks/overlap_trace.py", "--modes", "stage2", "--timeout", "35",
           "--out", str(ctx.scratch / "traces")]  # fmt: skip
    if ctx.cuda:
        return cmd + ["--device", "cuda", "--warmup", "2", "--steps", "3", "--profile-steps", "2"]
    return cmd + ["--device", "cpu", *TINY_GPT, "--micro", "1", "--warmup", "1", "--steps", "1",
                  "--profile-steps", "1"]  # fmt: skip


def _throughput(ctx: Ctx) -> list[str]:
    """Stage 2 + optimizer offload against plain PyTorch on the same GPU (DeepSpeed's same mode
    is a later lease's: its CPU Adam build takes minutes); the JSON is rewritten as each row
    finishes, so a row cut off at the limit leaves the finished ones."""
    cmd = [ctx.python, "benchmarks/engine_step.py", "--world", "1", "--stages", "2",
           "--modes", "2:cpu", "--json", str(ctx.scratch / "throughput.json")]  # fmt: skip
    if not ctx.cuda:
        return cmd + [*TINY_GPT, "--micro", "1", "--steps", "1", "--warmup", "1", "--impls",
                      "torch", "engine", "--no-deepspeed"]  # fmt: skip
    return cmd + [*GPT_1_3B, "--micro", "4", "--vocab", "50257", "--steps", "3", "--warmup",
                  "1", "--dtype", "bf16", "--checkpoint", "--timeout", "80", "--impls", "torch",
                  "engine", "--no-deepspeed"]  # fmt: skip


def _zenflow(ctx: Ctx) -> list[str]:
    """ZenFlow's step against plain offload on the same GPU (a 16.8M-param MLP, fp32), both
    rows in one process: the command has the step's 45 s less the interrupt's 10 s grace."""
    cmd = [ctx.python, "benchmarks/zenflow_step.py", "--rows", "offload", "zenflow",
           "--in-process", "--json", str(ctx.scratch / "zenflow.json")]  # fmt: skip
    if not ctx.cuda:
        return cmd + ["--quick"]
    return cmd + ["--hidden", "2048", "--layers", "4", "--micro", "64", "--steps", "8",
                  "--warmup", "2"]  # fmt: skip


def _zenflow3(ctx: Ctx) -> list[str]:
    """ZenFlow at stage 3 with the param shard in host memory (the device part reads and
    writes the selected elements there) against plain stage-3 offload, as ``_zenflow``."""
    cmd = _zenflow(ctx)
    cmd[cmd.index(str(ctx.scratch / "zenflow.json"))] = str(ctx.scratch / "zenflow3.json")
    return cmd + ["--stage", "3", "--offload-param"]


def _cpu_suite(ctx: Ctx) -> list[str]:
    sel = ["-m", "not cuda and not slow", "--ignore", PROBES, "--ignore", SANITIZER]
    if not ctx.cuda:
        return pytest(ctx, 120, 1, *sel, *REHEARSAL_TESTS)
    return pytest(ctx, 300, 14, *sel, "tests")


# The first lease's order and limits: the figures before the tests, every limit together within
# CAP_S (the check's default cap on a GPU; tests/test_gpu_check.py holds them to it). What a
# step leaves unused goes to the steps after it (gpu_check.step_limit): the install's 90 s are
# for a slow compile, and the tests at the end get what the figures did not use.
CAP_S = 480.0
STEPS: tuple[Step, ...] = (
    Step("install", "install.log", 90, False,
         lambda c: ["bash", "scripts/gpu_install.sh", *([] if c.cuda or c.install else ["--check"])]),
    Step("smoke", "install.log", 30, False, lambda c: [c.python, "scripts/gpu_smoke.py"]),
    Step("pcie", "bench.log", 20, True, _pcie, data=("pcie.json",)),
    Step("throughput", "bench.log", 90, True, _throughput, data=("throughput.json",)),
    Step("zenflow", "bench.log", 45, True, _zenflow, data=("zenflow.json",)),
    Step("zenflow3", "bench.log", 45, True, _zenflow3, data=("zenflow3.json",)),
    Step("overlap", "bench.log", 50, True, _overlap, data=("traces/summary.json",)),
    Step("cuda_tests", "cuda_tests.log", 65, True, _cuda_tests, skipped_ok=False),
    Step("cuda_probes", "cuda_probes.log", 20, True, _folder(PROBES, 20), skipped_ok=False),
    Step("sanitizer", "sanitizer.log", 25, True, _folder(SANITIZER, 20),
         env={"TORCH_CUDA_SANITIZER": "1"}, skipped_ok=False),
    Step("cpu_suite", "cpu_suite.log", None, False, _cpu_suite,
         env={"CUDA_VISIBLE_DEVICES": ""}, default=False),
)  # fmt: skip
