"""The one integer (and number) check of the package: what every size, count and token length goes through.

Why one: the planner, the cost files, the schedule IR and the CLI all take integers from users, and each used
to phrase the refusal its own way. Here the message always names where the value came from, the value, the
rule and the fix, e.g. ``granularity = 0 must be >= 1; use a positive token count such as 8``.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["check_int", "check_number"]


def check_int(value: Any, where: str, *, minimum: int = 1, fix: str = "fix the value",
              wrong_type: type[Exception] = TypeError) -> int:
    """``value`` as an int if it is one (numpy integers included, bools refused) and ``>= minimum``.

    ``wrong_type``: the exception for a non-integer. TypeError for API arguments; ValueError for values read
    from files or text, where a wrong type is a wrong value. A value below ``minimum`` is always a ValueError.
    """
    # numbers.Integral: numpy's integers register there, so they pass without this module importing numpy
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise wrong_type(f"{where} = {value!r} must be an integer >= {minimum}; {fix}")
    if value < minimum:
        raise ValueError(f"{where} = {value!r} must be >= {minimum}; {fix}")
    return int(value)


def check_number(value: Any, where: str, *, positive: bool = False, fix: str = "fix the value",
                 wrong_type: type[Exception] = ValueError) -> float:
    """``value`` as a finite float ``>= 0`` (``> 0`` if ``positive``); bools and strings are refused, not coerced."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise wrong_type(f"{where} = {value!r} is not a number; {fix}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{where} = {value!r} is not finite; {fix}")
    if x < 0 or (positive and x == 0):
        raise ValueError(f"{where} = {value!r} must be {'> 0' if positive else '>= 0'}; {fix}")
    return x
