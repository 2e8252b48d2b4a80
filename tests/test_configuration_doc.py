"""docs/configuration.md is what the parsers say: every flag of every command, with its help and
default (scripts/configuration_md.py writes it; rerun it when a flag changes)."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from kvpush.cli import parsers

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("configuration_md", ROOT / "scripts" / "configuration_md.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _flags() -> list[tuple[str, argparse.Action]]:
    return [(name, a) for name, p in parsers().items() for a in p._actions
            if not isinstance(a, argparse._HelpAction)]


def test_configuration_doc_is_current():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert doc == _generator().render(), "run: python scripts/configuration_md.py > docs/configuration.md"


def test_every_flag_is_documented_with_help_and_default():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    gen = _generator()
    for name, action in _flags():
        assert action.help, f"kvpush {name} {action.option_strings or action.dest}: no help line"
        for flag in action.option_strings:
            assert f"`{flag}`" in doc, f"kvpush {name} {flag} missing from docs/configuration.md"
        if action.option_strings:
            assert "default" in gen.flag_help(action), f"kvpush {name} {action.option_strings}: no default"


def test_help_states_defaults():
    """--help itself (not only the doc) prints each default."""
    text = parsers()["proxy"].format_help()
    assert "(default: 8000)" in text and "(default: round-robin)" in text  # --port, --policy
    assert "(default: none)" in parsers()["serve"].format_help()  # --api-key
