"""The text of the standalone ``zero_to_fp32.py`` a save writes beside ``latest``.

``zero_to_fp32_script.py`` is the script, importable in the package (the library's
``convert_zero_checkpoint_to_fp32_state_dict`` runs it) where it imports the checks of
``meta.json`` from ``meta_checks.py``. The copy a save writes must run without the package, so
that import is replaced by ``meta_checks.py``'s own text: the script and the library's reader
run the same checks, never two versions of them."""

from __future__ import annotations

from pathlib import Path

BEGIN = "# BEGIN SHARED CHECKS"
END = "# END SHARED CHECKS"
_FUTURE = "from __future__ import annotations\n"
SCRIPTS_DIR = Path(__file__).parent  # the standalone scripts a save copies, read as text


def recovery_script_source() -> bytes:
    """``zero_to_fp32_script.py`` with its import of ``meta_checks`` replaced by that file."""
    here = SCRIPTS_DIR
    script = (here / "zero_to_fp32_script.py").read_text(encoding="utf-8")
    checks = (here / "meta_checks.py").read_text(encoding="utf-8")
    begin, end = script.find(BEGIN), script.find(END)
    if begin < 0 or end < begin or _FUTURE not in checks:
        raise RuntimeError("zero_to_fp32_script.py: the shared-checks markers are missing")
    begin = script.index("\n", begin) + 1  # keep the marker lines themselves
    inlined = checks.replace(_FUTURE, "", 1)  # the script's own __future__ import is first
    return (script[:begin] + inlined + "\n" + script[end:]).encode("utf-8")
