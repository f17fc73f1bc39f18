"""Options objects' mistakes: :class:`OptionError` names the options as their fields are named (``kernels.linear
'x' is not one of auto, triton, torch``), so that a Python caller reads its own argument names; the command line
names its flags instead (:meth:`OptionError.naming`). Imports no torch."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence


class OptionError(ValueError):
    """A mistake in the values of ``options`` (field names), which the message names: :meth:`naming` renames each
    at its first occurrence."""

    def __init__(self, message: str, *options: str) -> None:
        super().__init__(message)
        self.options = options

    def naming(self, name: Callable[[str], str]) -> str:
        """The message with each option named by ``name(option)`` (a flag, for a command line)."""
        text = str(self)
        for option in self.options:
            flag = name(option)
            text = re.sub(rf"(?<![\w-]){re.escape(option)}(?![\w-])", lambda _, flag=flag: flag, text, count=1)
        return text


def check_at_least(option: str, value: int | float, low: int | float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise OptionError(f"{option} must be at least {low}, not {value!r}", option)


def check_one_of(option: str, value: object, choices: Sequence[object]) -> None:
    if value not in choices:
        raise OptionError(f"{option} {value!r} is not one of {', '.join(map(str, choices))}", option)


def check_names(option: str, values: Sequence[str], choices: Sequence[str] | None = None) -> None:
    """A list option: at least one value, each among ``choices`` where given."""
    if not values:
        raise OptionError(f"{option} is empty", option)
    for value in values if choices is not None else ():
        check_one_of(option, value, choices)
