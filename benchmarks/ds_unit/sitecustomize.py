"""Brings :mod:`plugin`'s adaptations into every process of a run, the test ranks included
(``multiprocessing`` starts them and they never load the pytest plugin): the harness stand-ins
at start-up, and the harness patches as soon as DeepSpeed's ``unit.common`` is imported. Active
only on ``run_selection.py``'s ``PYTHONPATH`` with ``DS_UNIT_STAND_INS=1`` and
``ZERO_OFFLOAD_AS_DEEPSPEED=1``."""

import importlib.abc
import importlib.machinery
import os
import sys


class _PatchHarnessOnImport(importlib.abc.MetaPathFinder):
    """Runs ``plugin.patch_harness`` right after ``unit.common`` executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "unit.common":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            import plugin

            plugin.patch_harness(module)

        spec.loader.exec_module = exec_and_patch
        return spec


if (
    os.environ.get("ZERO_OFFLOAD_AS_DEEPSPEED") == "1"
    and os.environ.get("DS_UNIT_STAND_INS") == "1"
):
    import plugin

    plugin.install_stand_ins()
    sys.meta_path.insert(0, _PatchHarnessOnImport())
