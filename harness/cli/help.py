"""How the commands meet their user in ``--help``: each command's summary, description and
one example, and the parser of a command made from them."""

from __future__ import annotations

import argparse
import textwrap
from dataclasses import dataclass
from typing import Any

PROG = "python -m harness"
WIDTH = 88
"""Where the help's own paragraphs wrap (argparse wraps the options' help to the terminal)."""


@dataclass(frozen=True)
class Command:
    """A command as its user meets it in ``--help``: what it does, and an example."""

    summary: str
    """One line, in the list of commands."""
    description: str
    """Its own ``--help``: what it does, what it writes."""
    example: str
    example_says: str


def examples(commands: dict[str, Command]) -> str:
    lines = [f"  {c.example}\n      {c.example_says}" for c in commands.values()]
    return "examples:\n" + "\n".join(lines)


def listed(commands: dict[str, Command]) -> str:
    width = max(map(len, commands))
    return "commands:\n" + "\n".join(
        f"  {name:<{width}}  {command.summary}" for name, command in commands.items()
    )


def add_command(commands: Any, name: str, command: Command) -> argparse.ArgumentParser:
    """The parser of the command ``name``, its help in a user's words."""
    parser: argparse.ArgumentParser = commands.add_parser(
        name,
        prog=f"{PROG} {name}",
        description=textwrap.fill(command.description, width=WIDTH),
        epilog=examples({name: command}),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser
