"""The DeepSpeed opt-in (``ZERO_OFFLOAD_AS_DEEPSPEED=1`` / ``zero_offload.as_deepspeed()``):
``import deepspeed`` and the ``deepspeed`` distribution resolve to zero_offload's namespace only
with the opt-in, the Hugging Face libraries' feature detection passes, unknown DeepSpeed names
fail by name. Every check that opts in runs in a fresh interpreter (the opt-in is per process;
the pytest process must keep seeing the real environment)."""

from __future__ import annotations

import importlib.machinery
import json
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

ENV = "ZERO_OFFLOAD_AS_DEEPSPEED"
PTH = "zero_offload_as_deepspeed.pth"
REAL = importlib.machinery.PathFinder.find_spec("deepspeed")  # an installed DeepSpeed, if any


def _python(code: str, env_value: str | None = None, timeout: float = 300) -> str:
    import os

    env = {k: v for k, v in os.environ.items() if k != ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="default")
    if env_value is not None:
        env[ENV] = env_value
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + "\n--stderr--\n" + proc.stderr


def _json(out: str) -> dict:
    return json.loads(next(ln for ln in out.splitlines() if ln.startswith("{")))


def test_pth_is_installed_and_cheap():
    """The install put the start-up hook into site-packages; without the variable it imports
    nothing (one environment lookup), and ``import zero_offload`` does not import torch."""
    site = Path(sysconfig.get_paths()["purelib"])
    text = (site / PTH).read_text()
    assert (
        text.startswith("import os;") and ENV in text and "zero_offload._as_deepspeed_hook" in text
    )
    out = _python(
        """
        import json, sys
        before = "zero_offload" in sys.modules
        import zero_offload
        print(json.dumps({"hook_loaded": before, "torch": "torch" in sys.modules}))
        """
    )
    assert _json(out) == {"hook_loaded": False, "torch": False}


def test_without_opt_in_nothing_changes():
    out = _python(
        """
        import importlib.metadata as md, importlib.util, json
        spec = importlib.util.find_spec("deepspeed")
        try:
            version = md.version("deepspeed")
        except md.PackageNotFoundError:
            version = None
        print(json.dumps({"origin": spec.origin if spec else None, "version": version}))
        """
    )
    got = _json(out)
    if REAL is None:
        assert got == {"origin": None, "version": None}
    else:
        assert got["origin"] == REAL.origin and "zero" not in (got["version"] or "")
    assert "zero_offload" not in out.split("--stderr--")[1]


@pytest.mark.parametrize("value", ["0", "false", "", "off"])
def test_false_values_leave_it_off(value):
    out = _python(
        """
        import importlib.util, json, sys
        spec = importlib.util.find_spec("deepspeed")
        print(json.dumps({"ours": bool(spec) and "zero_offload" in str(spec.loader)}))
        """,
        env_value=value,
    )
    assert _json(out) == {"ours": False}


def test_unrecognised_value_is_ignored_with_a_message():
    out = _python("print('{}')", env_value="maybe")
    assert f"ignoring {ENV}='maybe'" in out


def test_env_var_opt_in_at_interpreter_start():
    out = _python(
        """
        import importlib.metadata as md, importlib.util, json, sys
        spec = importlib.util.find_spec("deepspeed")
        meta = md.metadata("deepspeed")
        dist = md.distribution("deepspeed")
        torch_before = "torch" in sys.modules
        import deepspeed
        import deepspeed.zero
        import deepspeed.runtime.zero.partition_parameters as pp
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        from deepspeed.runtime.engine import DeepSpeedEngine
        import zero_offload
        from zero_offload.ops.adam import DeepSpeedCPUAdam as Ours
        print(json.dumps({
            "spec": spec.name, "version": md.version("deepspeed"), "name": meta["Name"],
            "dist_version": dist.version, "torch_before_import": torch_before,
            "module": deepspeed.__name__, "dunder_version": deepspeed.__version__,
            "zero_is_runtime_zero": deepspeed.zero is deepspeed.runtime.zero,
            "same_module": sys.modules["deepspeed.runtime.zero.partition_parameters"] is pp,
            "own_spec": pp.__spec__.name,
            "adam": DeepSpeedCPUAdam is Ours,
            "engine": DeepSpeedEngine is zero_offload.ZeroOffloadEngine,
            "listed": [d.metadata["Name"] for d in md.distributions() if d.metadata["Name"] == "deepspeed"
                       and "zero" in d.version],
        }))
        """,
        env_value="1",
    )
    got = _json(out)
    assert got["spec"] == "deepspeed"
    assert (
        got["version"]
        == got["dist_version"]
        == got["dunder_version"]
        == "0.19.8+zero.offload.0.1.0"
    )
    assert got["name"] == "deepspeed"
    assert got["torch_before_import"] is False  # the hook itself loads nothing heavy
    assert got["module"] == "zero_offload.deepspeed_compat"
    assert got["zero_is_runtime_zero"] and got["same_module"] and got["adam"] and got["engine"]
    assert got["own_spec"] == "zero_offload.deepspeed_compat.runtime.zero.partition_parameters"
    assert got["listed"] == []  # listings of every distribution show the real environment
    stderr = out.split("--stderr--")[1]
    if REAL is not None:  # the opt-in wins over the real one and says so, once
        assert stderr.count("not the installed DeepSpeed") == 1
    else:
        assert "not the installed DeepSpeed" not in stderr


def test_unknown_names_fail_by_name_and_feature_checks_see_them_absent():
    out = _python(
        """
        import json
        import zero_offload
        zero_offload.as_deepspeed()
        import deepspeed
        from deepspeed.accelerator import get_accelerator
        got = {"hasattr": hasattr(deepspeed, "tp_model_init"),
               "getattr_default": getattr(deepspeed.zero, "TiledLinear", "absent")}
        try:
            deepspeed.tp_model_init(model=None)
        except AttributeError as e:
            got["attr"] = [type(e).__name__, isinstance(e, NotImplementedError), str(e)]
        try:
            import deepspeed.ops.adagrad
        except ImportError as e:
            got["module"] = [type(e).__name__, isinstance(e, ModuleNotFoundError), e.name, str(e)]
        try:
            get_accelerator().memory_stats()
        except AttributeError as e:
            got["accel"] = str(e)
        from deepspeed.utils import groups
        got["dp_world"] = groups._get_data_parallel_world_size()
        got["sp_world"] = groups._get_sequence_parallel_world_size()
        print(json.dumps(got))
        """
    )
    got = _json(out)
    assert got["hasattr"] is False and got["getattr_default"] == "absent"
    name, is_nie, msg = got["attr"]
    assert name == "DeepSpeedNotProvidedError" and is_nie
    assert msg.startswith("deepspeed.tp_model_init: zero_offload does not provide")
    assert "tensor parallelism" in msg
    name, is_mnf, modname, msg = got["module"]
    assert (
        name == "DeepSpeedModuleNotProvidedError" and is_mnf and modname == "deepspeed.ops.adagrad"
    )
    assert "zero_offload does not provide this DeepSpeed module" in msg
    assert got["accel"].startswith("deepspeed.accelerator.get_accelerator().memory_stats:")
    assert got["dp_world"] == 1 and got["sp_world"] == 1


def test_hugging_face_feature_detection_passes():
    out = _python(
        """
        import json
        import zero_offload
        zero_offload.as_deepspeed()
        import os
        from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_available
        from transformers.dependency_versions_check import dep_version_check
        from accelerate.utils import is_deepspeed_available as acc_available
        from accelerate.utils.versions import compare_versions
        from trl.import_utils import is_deepspeed_available as trl_available
        dep_version_check("deepspeed")
        cfg = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})
        print(json.dumps({
            "transformers": is_deepspeed_available(), "accelerate": acc_available(),
            "trl": trl_available(), "gate": compare_versions("deepspeed", ">=", "0.16.4"),
            "zero3": cfg.is_zero3(), "env": os.environ.get("ZERO_OFFLOAD_AS_DEEPSPEED"),
        }))
        """
    )
    assert _json(out) == {
        "transformers": True,
        "accelerate": True,
        "trl": True,
        "gate": True,
        "zero3": True,
        "env": "1",  # as_deepspeed() passes the opt-in on to child processes
    }


def test_as_deepspeed_after_transformers_warns_and_after_real_deepspeed_refuses():
    out = _python(
        """
        import json, sys, types, warnings
        import transformers.integrations.deepspeed
        import zero_offload
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            zero_offload.as_deepspeed()
        print(json.dumps({"warned": [str(w.message) for w in caught]}))
        """
    )
    (msg,) = _json(out)["warned"]
    assert "was called after" in msg and "transformers.integrations.deepspeed" in msg
    out = _python(
        """
        import json, sys, types
        sys.modules["deepspeed"] = types.ModuleType("deepspeed")  # stands in for the real one
        import zero_offload
        try:
            zero_offload.as_deepspeed()
            print(json.dumps({"raised": None}))
        except RuntimeError as e:
            print(json.dumps({"raised": str(e)}))
        """
    )
    assert "the real DeepSpeed is already imported" in _json(out)["raised"]


def test_zero_offload_env_reports_the_opt_in():
    code = """
        import json, contextlib, io
        from zero_offload.cli.env import collect
        print(json.dumps(collect()["deepspeed_opt_in"]))
        """
    off = _json(_python(code))
    on = _json(_python(code, env_value="1"))
    assert off["active"] is False and on["active"] is True
    assert on["source"] == f"{ENV}=1" and on["reported_version"] == "0.19.8+zero.offload.0.1.0"
    assert (on["real_deepspeed"] is not None) == (REAL is not None)


def _pth_line() -> str:
    """The start-up line the install writes (setup.py's PTH_LINE), read without running setup."""
    import ast

    tree = ast.parse((Path(__file__).parents[1] / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PTH_LINE":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PTH_LINE")


@pytest.mark.parametrize(
    "value, hooked", [("0", False), ("", False), (" Off ", False), ("1", True)]
)
def test_pth_line_imports_the_package_only_when_on(value, hooked):
    """Off ("", 0, false, no, off) the start-up line imports nothing of zero_offload."""
    code = f"""
        import json, sys
        for name in [m for m in sys.modules if m.startswith("zero_offload")]:
            del sys.modules[name]  # whatever the installed .pth did at this start
        exec({_pth_line()!r})
        print(json.dumps({{"hooked": "zero_offload._as_deepspeed_hook" in sys.modules,
                          "package": "zero_offload" in sys.modules}}))
        """
    assert _json(_python(code, env_value=value)) == {"hooked": hooked, "package": hooked}


def test_pip_show_agrees_with_importlib_metadata():
    """Under the opt-in ``pip show deepspeed`` names what serves ``import deepspeed``; without
    it, pip and importlib.metadata both see the real environment."""
    import os

    def pip_show(env_value):
        env = {k: v for k, v in os.environ.items() if k != ENV}
        if env_value is not None:
            env[ENV] = env_value
        cmd = [sys.executable, "-m", "pip", "show", "deepspeed", "--disable-pip-version-check"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        fields = dict(ln.split(": ", 1) for ln in proc.stdout.splitlines() if ": " in ln)
        return proc.returncode, fields

    code = "import importlib.metadata as md, json; print(json.dumps(md.version('deepspeed')))"
    rc, fields = pip_show("1")
    assert rc == 0 and fields["Name"] == "deepspeed"
    assert fields["Version"] == json.loads(_python(code, env_value="1").splitlines()[0])
    assert "not DeepSpeed" in fields["Summary"]
    rc, fields = pip_show(None)
    if REAL is None:
        assert rc != 0 and "Version" not in fields
    else:
        assert "zero" not in fields["Version"]
