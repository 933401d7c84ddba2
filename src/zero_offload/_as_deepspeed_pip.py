"""``pip show deepspeed`` under the DeepSpeed opt-in: the distribution that serves
``import deepspeed`` (zero_offload's namespace), as ``importlib.metadata`` reports it.

pip lists the environment by walking ``sys.path`` for ``.dist-info`` folders, so it never asks
the opt-in's finder (which answers ``importlib.metadata`` look-ups by name only: listings and
``pip freeze`` keep showing the real environment). ``pip show`` names the package it asks
about, so there the answer is given: its query for ``deepspeed`` is served from the opt-in's
distribution instead of the ``sys.path`` walk (which finds nothing, or a real DeepSpeed that
``import deepspeed`` does not load). Imports neither torch nor the namespace."""

from __future__ import annotations

import re
from pathlib import Path


def _is_deepspeed(name: str) -> bool:
    return re.sub(r"[-_.]+", "-", name).lower() == "deepspeed"


def patch_pip_show(module) -> None:
    """Wrap ``pip._internal.commands.show.search_packages_info`` (looked up as a module global
    when the command runs). A pip whose ``_PackageInfo`` lacks the fields used is left alone.

    The wrapper takes whatever arguments the wrapped function takes (pip 23 passes only the
    query, later pips also ``include_files``) and passes them on unchanged; if the opt-in's own
    answer cannot be built, pip answers ``deepspeed`` itself: the opt-in never breaks pip."""
    orig = getattr(module, "search_packages_info", None)
    info_type = getattr(module, "_PackageInfo", None)
    fields = set(getattr(info_type, "_fields", ()))
    if orig is None or not {"name", "version", "location", "summary"} <= fields:
        return
    if getattr(orig, "zero_offload_wrapper", False):
        return

    def search_packages_info(query, *args, **kwargs):
        ours = [q for q in query if _is_deepspeed(q)]
        rest = [q for q in query if not _is_deepspeed(q)]
        if rest:
            yield from orig(rest, *args, **kwargs)
        if ours:
            include_files = kwargs.get("include_files", args[0] if args else True)
            try:
                info = _compat_info(info_type, fields, bool(include_files))
            except Exception:  # pip's own answer rather than a broken command
                yield from orig(ours, *args, **kwargs)
                return
            yield info

    search_packages_info.zero_offload_wrapper = True
    module.search_packages_info = search_packages_info


def _compat_info(info_type, fields: set[str], include_files: bool):
    from ._as_deepspeed import CompatDistribution

    meta = CompatDistribution().metadata
    values = {
        "name": meta["Name"],
        "version": meta["Version"],
        "location": str(Path(__file__).resolve().parent.parent),
        "editable_project_location": None,
        "requires": [],
        "required_by": [],
        "installer": "zero_offload",
        "metadata_version": meta["Metadata-Version"],
        "summary": meta["Summary"],
        "author": meta["Author"],
        "license": meta["License"],
        "files": [] if include_files else None,
    }
    empty_lists = {"classifiers", "project_urls", "entry_points", "requires", "required_by"}
    return info_type(
        **{f: values.get(f, [] if f in empty_lists else "") for f in info_type._fields}
    )
