"""Sphinx directives that render reference tables from the code, so that each fact exists once.

* ``bess-loop-options``: the options of :class:`pykeen_bess.training.BessTrainingLoop` as a table,
  read from the ``:param ...:`` fields of ``BessTrainingLoop.__init__``'s docstring, with each
  option's default from the signature.
* ``bess-cli``: the command line from ``pykeen_bess.cli.build_parser()``: every (sub)command's
  options, group by group, as tables (flags, default, help).
"""

from __future__ import annotations

import argparse
import inspect
import re
from typing import Any

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

#: options of ``__init__`` that are not training-loop options of their own
SKIPPED = {"self", "model", "triples_factory", "kwargs"}


def param_fields(docstring: str) -> dict[str, str]:
    """The ``:param name: text`` fields of a docstring (continuation lines joined)."""
    fields: dict[str, str] = {}
    current: str | None = None
    for line in inspect.cleandoc(docstring).splitlines():
        match = re.match(r":param (\w+):\s*(.*)", line)
        if match:
            current = match.group(1)
            fields[current] = match.group(2).strip()
        elif re.match(r":(param|type|raises?|returns?|rtype)\b", line) or not line.strip():
            current = None
        elif current is not None:
            fields[current] += " " + line.strip()
    return fields


def escape_cell(text: str) -> str:
    return text.replace("|", "\\|")


def help_cell(text: str) -> str:
    """An option's help as reST: flags and ``name@k`` metrics literal (not dashes, not e-mail links)."""
    text = escape_cell(text.replace("*", "\\*"))
    return re.sub(r"(?<![`\w-])(--[a-z][a-z0-9-]*|\w+@\w+)", r"``\1``", text)


def list_table(header: list[str], rows: list[list[str]], widths: str) -> list[str]:
    lines = [".. list-table::", "   :header-rows: 1", f"   :widths: {widths}", ""]
    for row in [header, *rows]:
        lines.append(f"   * - {row[0] or ' '}")
        lines.extend(f"     - {cell or ' '}" for cell in row[1:])
    return lines


class LoopOptions(SphinxDirective):
    """The training loop's options, from ``BessTrainingLoop.__init__``'s docstring."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from pykeen_bess.training import BessTrainingLoop

        init = BessTrainingLoop.__init__
        fields = param_fields(init.__doc__ or "")
        signature = inspect.signature(init)
        rows = []
        for name, parameter in signature.parameters.items():
            if name in SKIPPED or parameter.kind is inspect.Parameter.VAR_KEYWORD:
                continue
            if name not in fields:
                raise self.error(f"BessTrainingLoop.__init__'s docstring has no ':param {name}:'")
            default = "" if parameter.default is inspect.Parameter.empty else f"``{parameter.default!r}``"
            rows.append([f"``{name}``", default, fields[name]])
        if "kwargs" in fields:
            rows.append(["``**kwargs``", "", fields["kwargs"]])
        lines = list_table(["option", "default in the signature", "meaning"], rows, "18 14 68")
        container = nodes.container()
        self.state.nested_parse(StringList(lines, source="BessTrainingLoop.__init__"), self.content_offset, container)
        return [container]


def option_rows(parser: argparse.ArgumentParser) -> list[tuple[str, list[list[str]]]]:
    """Every argument group of a parser with its options (flags, default, help)."""
    groups = []
    for group in parser._action_groups:  # argparse keeps them only here
        rows = []
        for action in group._group_actions:
            if isinstance(action, argparse._SubParsersAction) or action.help == argparse.SUPPRESS:
                continue
            flags = ", ".join(f"``{flag}``" for flag in action.option_strings) or f"``{action.dest}``"
            if action.metavar and action.option_strings:
                flags += f" *{action.metavar}*" if isinstance(action.metavar, str) else ""
            elif action.choices and action.option_strings:
                flags += " {" + ",".join(str(choice) for choice in action.choices) + "}"
            default = action.default
            shown = "" if default in (None, argparse.SUPPRESS, False) else f"``{default}``"
            help_text = (action.help or "").replace("%(default)s", str(default))
            stated = re.search(r"\s*\(default: ([^()]{1,24})\)", help_text)
            if not shown and stated:  # the parser's defaults are suppressed (a --config fills them): its text's
                shown = f"``{stated.group(1).strip()}``"
                help_text = help_text[: stated.start()] + help_text[stated.end() :]
            rows.append([flags, shown, help_cell(help_text)])
        if rows:
            groups.append((group.title or "options", rows))
    return groups


def subcommands(parser: argparse.ArgumentParser, prefix: str) -> list[tuple[str, argparse.ArgumentParser]]:
    found = [(prefix, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.extend(subcommands(sub, f"{prefix} {name}"))
    return found


class CommandLine(SphinxDirective):
    """The command line's options, from ``pykeen_bess.cli.build_parser()``."""

    has_content = False

    def run(self) -> list[nodes.Node]:
        from pykeen_bess.cli import build_parser

        lines: list[str] = []
        for name, parser in subcommands(build_parser(), "pykeen-bess"):
            groups = option_rows(parser)
            if not groups or name == "pykeen-bess":
                continue
            lines += [f".. rubric:: ``{name}``", ""]
            if parser.description and name != "pykeen-bess train":
                lines += [escape_cell(parser.description.strip().splitlines()[0]), ""]
            for title, rows in groups:
                lines += [f"*{title}*", ""]
                lines += list_table(["option", "default", "meaning"], rows, "30 12 58")
                lines.append("")
        container = nodes.container()
        self.state.nested_parse(
            StringList(lines, source="pykeen_bess.cli.build_parser"), self.content_offset, container
        )
        return [container]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("bess-loop-options", LoopOptions)
    app.add_directive("bess-cli", CommandLine)
    return {"version": "1", "parallel_read_safe": True}
