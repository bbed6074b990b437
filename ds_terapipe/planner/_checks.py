"""The one integer (and number) check of the package: what every size, count and token length goes through.

Why one: the planner, the cost files, the schedule IR and the CLI all take integers from users, and each used
to phrase the refusal its own way. Here the message always names where the value came from, the value, the
rule and the fix, e.g. ``granularity = 0 must be >= 1; use a positive token count such as 8``. The bound on
the slicing planner's grid (``too_many_units``) is here too, so the config and the CLI refuse a grid too fine to
search as the planner does, without importing it.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

__all__ = ["MAX_UNITS", "check_int", "check_number", "fitting_granularity", "too_many_units"]


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


#: Most slice units (seq_len / granularity) the DP searches: its tables are (units + 1)^2 and its time grows
#: faster than their square (1024 units: about 3 s on a 2-core host, 2048: about 20 s; 16384: 2 GiB per table).
MAX_UNITS = 2048


def fitting_granularity(seq_len: int, granularity: int, max_units: int | None = None) -> int:
    """The finest grid for ``seq_len`` with at most ``max_units`` units (default :data:`MAX_UNITS`):
    ``granularity`` times the smallest factor of ``seq_len // granularity`` that leaves no more (``seq_len``
    itself, one slice, when no smaller factor does). ``granularity`` must divide ``seq_len``."""
    max_units = MAX_UNITS if max_units is None else max_units
    units = seq_len // granularity
    if units <= max_units:
        return granularity
    low = -(-units // max_units)
    factor = next((f for f in range(low, min(units, low + 100_000) + 1) if units % f == 0), units)
    return granularity * factor


def too_many_units(seq_len: int, granularity: int, names: tuple[str, str] = ("seq_len = ", "granularity = ")
                   ) -> str | None:
    """Why ``seq_len`` at ``granularity`` is too fine a grid to search (more than MAX_UNITS units) and which
    granularity to use instead, in the caller's ``names`` for the two; None when it is not."""
    units = seq_len // granularity
    if units <= MAX_UNITS:
        return None
    return (f"{names[0]}{seq_len} at {names[1]}{granularity} is {units} slice units, more than the {MAX_UNITS} the "
            f"planner searches (its time grows faster than their square); use "
            f"{names[1]}{fitting_granularity(seq_len, granularity)} or coarser")
