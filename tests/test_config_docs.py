"""The config reference: every config field carries its description, and docs/config.md is the
page generated from them (``zero-offload config-docs``), never a stale copy."""

from __future__ import annotations

from pathlib import Path

import pytest

from zero_offload.cli.main import main
from zero_offload.config import SchedulerConfig, ZeroOffloadConfig
from zero_offload.config.fields import Section
from zero_offload.config.reference import field_type_text, render, section_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _all_sections(base: type[Section] = Section) -> list[type[Section]]:
    """The config's sections (not the DeepSpeed namespace's constructor views of them, such as
    its ``DeepSpeedZeroConfig``, a ``ZeroConfig`` built from keyword arguments)."""
    out = []
    for cls in base.__subclasses__():
        if cls.__module__.startswith("zero_offload.config"):
            out.append(cls)
        out += _all_sections(cls)
    return out


def test_docs_config_md_is_generated_from_the_fields() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        "docs/config.md is stale: run `zero-offload config-docs --out docs/config.md`"
    )


def test_every_config_field_has_a_description() -> None:
    sections = _all_sections()
    assert ZeroOffloadConfig in sections and len(sections) >= 19
    missing = [
        f"{cls.__name__}.{name}"
        for cls in sections
        for name, field in cls.model_fields.items()
        if not (field.description or "").strip()
    ]
    assert missing == []


def test_every_reachable_key_is_in_the_page() -> None:
    text = render()
    docs = list(section_docs())
    # Every section but the scheduler types' common base is a table of the page.
    assert set(_all_sections()) - {SchedulerConfig} <= {d.model for d in docs}
    for doc in docs:
        for name, field in doc.model.model_fields.items():
            key = f"{doc.path}.{name}" if doc.path else name
            assert f"| `{key}`" in text, key
            assert field.description in text, key


def test_types_and_defaults_come_from_the_fields() -> None:
    text = render()
    zc = "| `zero_optimization.reduce_bucket_size` | integer > 0 | `500000000` |"
    assert zc in text
    assert "| `train_batch_size` | integer > 0 or null | `null` |" in text
    assert "<br>also `prefetch_bucket_size`" in text  # DeepSpeed's other spelling
    section = ZeroOffloadConfig.model_fields["zero_optimization"]
    assert field_type_text(section) == "object"
    assert "Accepted, not built (named in the not-built warning when on): `load_universal`," in text


def test_cli_writes_and_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "config.md"
    assert main(["config-docs", "--check", str(page)]) == 1
    assert "is missing" in capsys.readouterr().err
    assert main(["config-docs", "--out", str(page)]) == 0
    assert page.read_text(encoding="utf-8") == render()
    assert main(["config-docs", "--check", str(page)]) == 0
    page.write_text(render().replace("`500000000`", "`1`"), encoding="utf-8")
    assert main(["config-docs", "--check", str(page)]) == 1
    err = capsys.readouterr().err
    assert f"{page} is stale" in err and f"config-docs --out {page}" in err
