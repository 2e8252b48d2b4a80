"""Write docs/configuration.md from the CLI's parsers: every flag of every command, grouped as --help
groups them, with its default and help. tests/test_configuration_doc.py fails when the file is stale.

    python scripts/configuration_md.py > docs/configuration.md
"""

from __future__ import annotations

import argparse
import sys

from kvpush.cli import parsers
from kvpush.flags import HelpFormatter

ORDER = ("serve", "proxy", "up", "bench", "bench compare", "demo", "make-model", "env", "profile")
HEADER = """# Configuration

Every flag of every `kvpush` command, grouped as `--help` groups them. Generated from the parsers by
`python scripts/configuration_md.py > docs/configuration.md`; `tests/test_configuration_doc.py` fails
when a flag is missing here or its text changed. Defaults come from the config dataclasses
(`kvpush/config.py`); `kvpush up` passes every flag it does not know to each `kvpush serve`.
"""


def flag_help(action: argparse.Action) -> str:
    """The help line as --help prints it, default included, on one line."""
    text = HelpFormatter("kvpush")._get_help_string(action) or ""
    params = {**vars(action), "default": action.default}
    if isinstance(action.choices, (list, tuple)):
        params["choices"] = ", ".join(map(str, action.choices))
    return " ".join((text % params).split()).replace("|", "\\|")


def names(action: argparse.Action) -> str:
    flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices:
        flags += " {" + ", ".join(map(str, action.choices)) + "}"
    return flags


def section(name: str, parser: argparse.ArgumentParser) -> list[str]:
    lines = [f"## kvpush {name}", ""]
    if parser.description and name not in ("bench compare",):
        lines += [" ".join(parser.description.split()), ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction)]
        if not actions:
            continue
        title = "arguments" if group.title in ("options", "positional arguments") else group.title
        lines += [f"**{title}**", "", "| flag | meaning |", "|---|---|"]
        lines += [f"| {names(a)} | {flag_help(a)} |" for a in actions]
        lines.append("")
    return lines


def render() -> str:
    all_parsers = parsers()
    lines = [HEADER]
    for name in ORDER:
        lines += section(name, all_parsers[name])
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(render())
