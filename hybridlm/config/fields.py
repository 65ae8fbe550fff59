"""What every config section is made of: a field that is also a flag, and the one error type.

A field's metadata carries its help text, choices and aliases, so the argparse parser, the
YAML loader and the README's flag table are all generated from the dataclasses.
"""
from __future__ import annotations

from dataclasses import field


class ConfigError(ValueError):
    """A bad flag, file or combination; the message is one sentence naming it."""


def flag(default, help: str, *, choices=None, aliases=(), cli: bool = True, nargs=None):
    return field(default=default, metadata={"help": help, "choices": choices, "aliases": aliases, "cli": cli, "nargs": nargs})



def refuse_first(flag: str, cases) -> None:
    """One sentence for the first (is_bad, why) case that holds: "<flag> cannot be combined with <why>."."""
    why = next((why for bad, why in cases if bad), None)
    if why:
        raise ConfigError(f"{flag} cannot be combined with {why}.")

