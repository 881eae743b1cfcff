"""Argument checks in torch's wording, in one place.

A wrong argument raises `TypeError` when its type is wrong and `ValueError` when its type is
right and its value is not, with the message torch uses for its own arguments:

    <name> should be <what is accepted>, but got <name>=<value!r>

so that users' error handling written for torch keeps working, and every message names the
argument and what it accepts. Where torch raises another type or words it otherwise for the
same argument (`stoker.torch` must match torch's message), the caller keeps torch's words.

This module imports nothing of stoker: every layer may use it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection
from typing import Any, NoReturn, TypeVar

__all__ = ["check_bool", "check_callable", "check_choice", "check_int", "check_number", "fail"]

T = TypeVar("T")


def fail(error: type[Exception], name: str, accepted: str, value: Any) -> NoReturn:
    """Raise `error` worded as torch words a bad argument.

    Args:
        error: `TypeError` (a wrong type) or `ValueError` (a wrong value).
        name: The argument's name.
        accepted: What it accepts, e.g. "an int >= 1".
        value: What it got.

    Raises:
        TypeError or ValueError: always, "<name> should be <accepted>, but got <name>=<value!r>".
    """
    raise error(f"{name} should be {accepted}, but got {name}={value!r}")


def _range(low: float | None, high: float | None, above: float | None = None) -> str:
    parts = []
    if above is not None:
        parts.append(f"> {above:g}" if isinstance(above, float) else f"> {above}")
    if low is not None:
        parts.append(f">= {low:g}" if isinstance(low, float) else f">= {low}")
    if high is not None:
        parts.append(f"<= {high:g}" if isinstance(high, float) else f"<= {high}")
    return " and ".join(parts)


def _accepted(kind: str, bounds: str, unit: str | None, none_ok: bool) -> str:
    text = f"{kind} {bounds}".rstrip() if bounds else kind
    if unit:
        text += f" ({unit})"
    return text + (" or None" if none_ok else "")


def check_int(
    name: str,
    value: Any,
    *,
    low: int | None = None,
    high: int | None = None,
    unit: str | None = None,
    none_ok: bool = False,
) -> Any:
    """`value` as an int, if it is an integer (an `int` or a numpy integer, not a bool) within
    the bounds.

    Args:
        name: The argument's name, for the message.
        value: The argument.
        low: The least value accepted; None means no bound. Defaults to None.
        high: The greatest value accepted; None means no bound. Defaults to None.
        unit: What the number counts ("bytes", "seconds"), said in the message; None says
            nothing. Defaults to None.
        none_ok: Whether None is accepted (and returned). Defaults to False.

    Returns:
        `int(value)`, or None when `value` is None and `none_ok`.

    Raises:
        TypeError: when `value` is not an integer (nor None, with `none_ok`).
        ValueError: when it is outside [`low`, `high`].
    """
    if value is None and none_ok:
        return None
    accepted = _accepted("an int", _range(low, high), unit, none_ok)
    if isinstance(value, bool):
        fail(TypeError, name, accepted, value)
    try:
        number = operator.index(value)
    except TypeError:
        fail(TypeError, name, accepted, value)
    if (low is not None and number < low) or (high is not None and number > high):
        fail(ValueError, name, accepted, value)
    return number


def check_number(
    name: str,
    value: Any,
    *,
    low: float | None = None,
    above: float | None = None,
    high: float | None = None,
    finite: bool = True,
    unit: str | None = None,
    none_ok: bool = False,
) -> Any:
    """`value` as a float, if it is a real number (not a bool) within the bounds.

    Args:
        name: The argument's name, for the message.
        value: The argument.
        low: The least value accepted; None means no bound. Defaults to None.
        above: A bound the value must exceed; None means none. Defaults to None.
        high: The greatest value accepted; None means no bound. Defaults to None.
        finite: Whether infinity and NaN are refused. Defaults to True.
        unit: What the number measures ("seconds", "bytes"), said in the message; None says
            nothing. Defaults to None.
        none_ok: Whether None is accepted (and returned). Defaults to False.

    Returns:
        `float(value)`, or None when `value` is None and `none_ok`.

    Raises:
        TypeError: when `value` is not a real number (nor None, with `none_ok`).
        ValueError: when it is NaN, infinite (with `finite`), or outside the bounds.
    """
    if value is None and none_ok:
        return None
    kind = "a finite number" if finite else "a number"
    accepted = _accepted(kind, _range(low, high, above), unit, none_ok)
    if isinstance(value, (bool, str, bytes)):
        fail(TypeError, name, accepted, value)
    try:
        number = float(value)
    except (TypeError, ValueError):
        fail(TypeError, name, accepted, value)
    if (
        math.isnan(number)
        or (finite and math.isinf(number))
        or (low is not None and number < low)
        or (above is not None and not number > above)
        or (high is not None and number > high)
    ):
        fail(ValueError, name, accepted, value)
    return number


def check_bool(name: str, value: Any) -> bool:
    """`value`, if it is True or False.

    Args:
        name: The argument's name, for the message.
        value: The argument.

    Returns:
        `value`.

    Raises:
        TypeError: when `value` is not a bool.
    """
    if not isinstance(value, bool):
        fail(TypeError, name, "True or False", value)
    return value


def check_callable(name: str, value: Any, *, none_ok: bool = False, takes: str | None = None) -> Any:
    """`value`, if it is callable.

    Args:
        name: The argument's name, for the message.
        value: The argument.
        none_ok: Whether None is accepted. Defaults to False.
        takes: What the callable is called with, said in the message (e.g. "a binary file");
            None says nothing. Defaults to None.

    Returns:
        `value`.

    Raises:
        TypeError: when `value` is not callable (nor None, with `none_ok`).
    """
    if value is None and none_ok:
        return None
    if not callable(value):
        accepted = "a callable" + (f" taking {takes}" if takes else "") + (" or None" if none_ok else "")
        fail(TypeError, name, accepted, value)
    return value


def check_choice(name: str, value: T, choices: Collection[Any], *, also: str | None = None) -> T:
    """`value`, if it is one of `choices`.

    Args:
        name: The argument's name, for the message.
        value: The argument.
        choices: The values accepted, listed in the message in their order.
        also: What else the caller accepts, said after the choices (e.g. "a callable");
            None says nothing. Defaults to None.

    Returns:
        `value`.

    Raises:
        ValueError: when `value` is not one of `choices`.
    """
    try:
        found = value in choices
    except TypeError:  # unhashable, for a set of choices
        found = False
    if not found:
        listed = [repr(c) for c in choices] + ([also] if also else [])
        accepted = listed[0] if len(listed) == 1 else ", ".join(listed[:-1]) + " or " + listed[-1]
        fail(ValueError, name, accepted, value)
    return value
