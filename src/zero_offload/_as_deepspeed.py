"""The DeepSpeed opt-in: ``import deepspeed`` gives zero_offload's DeepSpeed-compatible namespace.

Hugging Face ``Trainer``, Accelerate and TRL reach DeepSpeed only through a module named
``deepspeed`` and an installed distribution named ``deepspeed`` (its version gates their
features). With the opt-in, for this process (and its children, through the environment):

* ``import deepspeed`` and every ``import deepspeed.<sub>`` resolve to
  ``zero_offload.deepspeed_compat[.<sub>]`` (a meta-path finder placed first, so an installed
  DeepSpeed is not used; ``sys.modules["deepspeed"]`` is that very module);
* ``importlib.metadata.version("deepspeed")`` (``distribution``, ``metadata``) answers with the
  DeepSpeed version whose API zero_offload implements, marked as zero_offload's with a PEP 440
  local label (``0.19.8+zero.offload.0.1.0``); ``importlib.util.find_spec("deepspeed")`` finds
  the namespace; ``pip show deepspeed`` shows that same distribution (``_as_deepspeed_pip``).

Nothing is installed under DeepSpeed's name and nothing changes without the opt-in:
``ZERO_OFFLOAD_AS_DEEPSPEED=1`` in the environment (read at interpreter start by the
``zero_offload_as_deepspeed.pth`` file the package installs, so it passes through torchrun,
``accelerate launch`` and ``zero-offload launch`` to every rank), or :func:`as_deepspeed` called
before transformers or accelerate is imported.

This module imports neither torch nor the namespace: both load on the first ``import deepspeed``.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
import warnings
from pathlib import Path

ENV = "ZERO_OFFLOAD_AS_DEEPSPEED"
ALIAS = "deepspeed"
TARGET = "zero_offload.deepspeed_compat"
DEEPSPEED_API_VERSION = "0.19.8"  # the DeepSpeed release whose API the namespace implements

# deepspeed.<key> is zero_offload.deepspeed_compat.<value> (DeepSpeed's own aliases)
_SUBMODULE_ALIASES = {"zero": "runtime.zero"}
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")

log = logging.getLogger("zero_offload")


class DeepSpeedNotProvidedError(AttributeError, NotImplementedError):
    """A DeepSpeed name zero_offload does not implement, used through the ``deepspeed``
    namespace. An ``AttributeError`` so that ``hasattr(deepspeed, name)`` and ``getattr(...,
    default)`` feature checks answer "absent" as they would for an older DeepSpeed; a use of the
    name fails here, at the name, with this message."""

    def __init__(self, api: str, hint: str = "") -> None:
        self.api = api
        super().__init__(
            f"{api}: zero_offload does not provide this DeepSpeed API (zero_offload "
            f"{_zero_offload_version()} implements DeepSpeed {DEEPSPEED_API_VERSION}'s ZeRO "
            "stages 0-3 data parallelism with CPU and NVMe offload: initialize and the engine, "
            "zero.Init, "
            "GatheredParameters, comm, ops.adam, checkpoints; not tensor, pipeline, sequence or "
            f"expert parallelism, inference or compression){hint}"
        )


class DeepSpeedModuleNotProvidedError(ModuleNotFoundError):
    """``import deepspeed.<sub>`` of a DeepSpeed module zero_offload does not implement."""

    def __init__(self, fullname: str) -> None:
        super().__init__(
            f"No module named {fullname!r}: zero_offload does not provide this DeepSpeed module "
            f"(ZERO_OFFLOAD_AS_DEEPSPEED is active: 'deepspeed' is zero_offload "
            f"{_zero_offload_version()}'s namespace for DeepSpeed {DEEPSPEED_API_VERSION}'s ZeRO "
            "data-parallel API)",
            name=fullname,
        )


def not_provided_getattr(module_name: str, hints: dict[str, str] | None = None):
    """A module ``__getattr__`` for the namespace: unknown names raise
    :class:`DeepSpeedNotProvidedError` under their DeepSpeed name."""
    alias = ALIAS + module_name[len(TARGET) :]
    hints = hints or {}

    def __getattr__(name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(f"module {alias!r} has no attribute {name!r}")
        raise DeepSpeedNotProvidedError(f"{alias}.{name}", hints.get(name, ""))

    return __getattr__


def _zero_offload_version() -> str:
    from . import __version__

    return __version__


def compat_version() -> str:
    """``0.19.8+zero.offload.<zero_offload version>``: DeepSpeed's version number (its API is
    what version gates ask about) with a PEP 440 local label saying whose it is."""
    local = re.sub(r"[^A-Za-z0-9]+", ".", _zero_offload_version()).strip(".")
    return f"{DEEPSPEED_API_VERSION}+zero.offload.{local}"


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# ---- the distribution ---------------------------------------------------------------------------
class CompatDistribution(importlib.metadata.Distribution):
    """``importlib.metadata``'s view of the namespace: name ``deepspeed``, the compat version."""

    def read_text(self, filename):
        if filename in ("METADATA", "PKG-INFO"):
            return (
                "Metadata-Version: 2.1\n"
                f"Name: {ALIAS}\n"
                f"Version: {compat_version()}\n"
                f"Summary: zero_offload {_zero_offload_version()}'s DeepSpeed-compatible namespace "
                f"(DeepSpeed {DEEPSPEED_API_VERSION}'s ZeRO API), active because of the "
                f"{ENV} opt-in; not DeepSpeed\n"
                "Author: zero_offload\n"
                "License: Apache-2.0\n"
            )
        if filename == "top_level.txt":
            return f"{ALIAS}\n"
        if filename == "INSTALLER":
            return "zero_offload\n"
        return None

    def locate_file(self, path):
        return Path(__file__).parent / "deepspeed_compat" / path


# ---- the finder ---------------------------------------------------------------------------------
class _AliasLoader(importlib.abc.Loader):
    """Loads ``deepspeed[.x]`` as the already-importable ``zero_offload.deepspeed_compat[.x]``:
    the same module object under both names."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self.target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module) -> None:
        # The import system stamped the alias spec on the module; it keeps its own.
        module.__spec__ = self._target_spec

    def get_code(self, fullname):
        """The target's code: ``python -m deepspeed[.x]`` (runpy) runs the namespace's module."""
        spec = importlib.util.find_spec(self.target)
        return spec.loader.get_code(self.target)


class AsDeepSpeedFinder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path`` while the opt-in is active: ``deepspeed`` names only."""

    source = "unknown"
    _announced = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _POST_IMPORT:
            return self._patched_spec(fullname, path, target)
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        rest = fullname[len(ALIAS) :]
        for short, real in _SUBMODULE_ALIASES.items():
            if rest == "." + short or rest.startswith("." + short + "."):
                rest = "." + real + rest[len(short) + 1 :]
        real_name = TARGET + rest
        if fullname == ALIAS:
            self._announce()
        try:
            real_spec = importlib.util.find_spec(real_name)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            raise DeepSpeedModuleNotProvidedError(fullname)
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(real_name),
            origin=real_spec.origin,  # runpy's sys.argv[0] for ``python -m deepspeed``
            is_package=real_spec.submodule_search_locations is not None,
        )

    def _patched_spec(self, fullname, path, target):
        """Another library's module, found by the finders after this one, whose loader is
        wrapped to adapt the module once it has run (``_POST_IMPORT``)."""
        later = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
        for finder in later:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader, _POST_IMPORT[fullname])
                return spec
        return None

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is None or _normalize(name) != ALIAS:
            return iter(())  # listings of every distribution show the real environment
        return iter((CompatDistribution(),))

    def _announce(self) -> None:
        if AsDeepSpeedFinder._announced:
            return
        AsDeepSpeedFinder._announced = True
        real = real_deepspeed()
        if real is not None:
            log.warning(
                "zero_offload: %s is active (%s): 'import deepspeed' is zero_offload %s's "
                "DeepSpeed-compatible namespace (version %s), not the installed DeepSpeed %s at %s",
                ENV,
                self.source,
                _zero_offload_version(),
                compat_version(),
                real["version"],
                real["location"],
            )


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader, patch) -> None:
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        self.loader.exec_module(module)
        self.patch(module)

    def __getattr__(self, name):  # get_source, get_resource_reader, ...: the real loader's
        return getattr(self.loader, name)


def _patch_accelerate_state(module) -> None:
    """accelerate (1.15) finds no distributed backend on a machine without a GPU unless it runs
    with ``cpu=True``, which turns DeepSpeed off: a DeepSpeed run under a launcher then sees
    every process as process 0 of 1 (and fails the batch-size check). With the opt-in, such a
    run gets gloo, as zero_offload's CPU ranks use: each process is its own rank."""
    state = getattr(module, "PartialState", None)
    orig = getattr(state, "_prepare_backend", None)
    multi_cpu = getattr(getattr(module, "DistributedType", None), "MULTI_CPU", None)
    if orig is None or multi_cpu is None or getattr(orig, "zero_offload_wrapper", False):
        return  # another accelerate: leave it as it is

    def _prepare_backend(self, *args, **kwargs):
        found, kind = orig(self, *args, **kwargs)
        cpu = kwargs.get("cpu", args[0] if args else False)
        asked = kwargs.get("backend", args[2] if len(args) > 2 else None)
        if (
            found is None
            and not cpu
            and int(os.environ.get("LOCAL_RANK", -1)) != -1
            and os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        ):
            return asked or "gloo", multi_cpu
        return found, kind

    _prepare_backend.zero_offload_wrapper = True
    state._prepare_backend = _prepare_backend


def _patch_pip_show(module) -> None:
    from ._as_deepspeed_pip import patch_pip_show

    patch_pip_show(module)


def _patch_hf_config_reader(module) -> None:
    """accelerate's ``HfDeepSpeedConfig`` (transformers' Trainer config subclasses it) reads a
    config file into a dict that reaches ``deepspeed.initialize`` without the file's name: the
    reader records it (:mod:`zero_offload.config.loading.origin`), so load messages name the file."""
    reader = getattr(module, "HfDeepSpeedConfig", None)
    orig = getattr(reader, "__init__", None)
    if orig is None or getattr(orig, "zero_offload_wrapper", False):
        return

    def __init__(self, config_file_or_dict, *args, **kwargs):
        orig(self, config_file_or_dict, *args, **kwargs)
        path = config_file_or_dict
        if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
            from .config.loading.origin import remember

            remember(getattr(self, "config", None), path)

    __init__.zero_offload_wrapper = True
    reader.__init__ = __init__


# other libraries' modules adapted as they are imported (only while the opt-in is active)
_POST_IMPORT = {
    "accelerate.utils.deepspeed": _patch_hf_config_reader,
    "accelerate.state": _patch_accelerate_state,
    "pip._internal.commands.show": _patch_pip_show,
}

_finder: AsDeepSpeedFinder | None = None


def is_active() -> bool:
    return _finder is not None and _finder in sys.meta_path


def real_deepspeed() -> dict | None:
    """The installed DeepSpeed the opt-in shadows (its version and location), or None."""
    spec = importlib.machinery.PathFinder.find_spec(ALIAS)
    if spec is None:
        return None
    version = None
    ctx = importlib.metadata.DistributionFinder.Context(name=ALIAS)
    for dist in importlib.metadata.MetadataPathFinder.find_distributions(ctx):
        version = dist.version
        break
    location = spec.submodule_search_locations
    where = list(location)[0] if location else spec.origin
    return {"version": version, "location": where}


def status() -> dict:
    """For ``zero-offload env``: whether the opt-in is active (and from where), the version it
    reports, and the real DeepSpeed it shadows, if one is installed."""
    return {
        "active": is_active(),
        "source": _finder.source if is_active() else None,
        "env": os.environ.get(ENV),
        "reported_version": compat_version(),
        "real_deepspeed": real_deepspeed(),
    }


def _activate(source: str) -> None:
    global _finder
    if is_active():
        return
    loaded = sys.modules.get(ALIAS)
    if loaded is not None and not getattr(loaded, "__name__", "").startswith(TARGET):
        raise RuntimeError(
            f"zero_offload.as_deepspeed(): the real DeepSpeed is already imported "
            f"({getattr(loaded, '__file__', loaded)!r}); call as_deepspeed() (or set {ENV}=1) "
            "before anything imports deepspeed"
        )
    _finder = AsDeepSpeedFinder()
    _finder.source = source
    sys.meta_path.insert(0, _finder)
    importlib.invalidate_caches()
    for name, patch in _POST_IMPORT.items():
        if name in sys.modules:
            patch(sys.modules[name])


def as_deepspeed() -> None:
    """Opt in: from now on ``import deepspeed`` is zero_offload's DeepSpeed-compatible namespace
    (see the module docstring), in this process and, through ``ZERO_OFFLOAD_AS_DEEPSPEED=1`` in
    the environment, in the processes it starts. Call it at the top of a script, before
    transformers, accelerate or trl is imported (they check for DeepSpeed when imported).
    Idempotent."""
    early = sorted(
        m
        for m in ("transformers.integrations.deepspeed", "accelerate.accelerator", "trl")
        if m in sys.modules
    )
    _activate("zero_offload.as_deepspeed()")
    os.environ[ENV] = "1"
    if early:
        warnings.warn(
            f"zero_offload.as_deepspeed() was called after {' and '.join(early)} "
            f"{'were' if len(early) > 1 else 'was'} imported: "
            "those modules decided at import time that DeepSpeed is absent. Call it before "
            f"importing them, or set {ENV}=1 in the environment",
            RuntimeWarning,
            stacklevel=2,
        )


def activate_from_environment() -> None:
    """The interpreter-start hook: activate when ``ZERO_OFFLOAD_AS_DEEPSPEED`` is true."""
    raw = os.environ.get(ENV)
    if raw is None:
        return
    value = raw.strip().lower()
    if value in _TRUE:
        _activate(f"{ENV}={raw}")
    elif value not in _FALSE:
        sys.stderr.write(
            f"zero_offload: ignoring {ENV}={raw!r} (use 1 to use zero_offload as deepspeed, "
            "0 or unset for not)\n"
        )
