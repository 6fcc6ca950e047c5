"""The README's CLI table is the parser: the same subcommands in the same order, and each
row names exactly the flags its subcommand's `--help` shows (no missing, none stale)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from rlfeed.service.cli import COMMANDS, build_parser

README = Path(__file__).resolve().parents[3] / "README.md"
FLAG = re.compile(r"(?<![\w-])--\[?(?:no-\]?)?[a-z][a-z0-9-]*|(?<![\w-])-o\b")


def _cli_rows() -> dict[str, str]:
    """subcommand -> its table row, from the README's `## CLI` section."""
    section = README.read_text().split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = re.match(r"\| `rlfeed (\w+)[ `]", line)
        if match:
            rows[match.group(1)] = line
    return rows


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _visible_flags(parser: argparse.ArgumentParser) -> list[set[str]]:
    """The flags `--help` shows, each as its spellings (`-o`/`--output`; a
    BooleanOptionalAction as the README writes it, `--[no-]x`); `--help` itself left out."""
    flags = []
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or not action.option_strings:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        if isinstance(action, argparse.BooleanOptionalAction):
            flags.append({"--[no-]" + action.option_strings[0][2:]})
        else:
            flags.append(set(action.option_strings))
    return flags


def _flags_in(row: str) -> set[str]:
    return set(FLAG.findall(row))


def test_the_table_lists_every_subcommand_in_help_order():
    assert list(_cli_rows()) == list(COMMANDS)


def test_each_row_names_exactly_the_flags_of_its_subcommand():
    rows, parsers = _cli_rows(), _subparsers()
    for name, parser in parsers.items():
        in_help, in_readme = _visible_flags(parser), _flags_in(rows[name])
        missing = [sorted(spellings) for spellings in in_help if not spellings & in_readme]
        assert missing == [], f"README's `rlfeed {name}` row lacks these flags"
        unknown = in_readme - set().union(*in_help)
        assert unknown == set(), f"README's `rlfeed {name}` row names flags it does not have"


def test_the_section_names_the_top_level_flags_and_the_address_variables():
    section = README.read_text().split("\n## CLI\n", 1)[1].split("\n## ", 1)[0]
    assert "`rlfeed --version`" in section and "`rlfeed --help`" in section
    for variable in ("$RLFEED_ADDRESS", "$RAY_ADDRESS"):
        assert variable in section
