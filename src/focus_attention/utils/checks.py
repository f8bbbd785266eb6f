"""Field checks shared by the settings classes (``FocusConfig``, ``TrainConfig``).

Each raises ``ValueError("<Owner>.<field>: received <value!r>, expected <what>")``. Plain
Python with no heavy imports, so that ``focus_attention.train`` can use it without loading
transformers.
"""

from __future__ import annotations

import argparse
import dataclasses
import math


def bad(owner: str, name: str, received: object, expected: str) -> ValueError:
    """The ``ValueError`` for field ``name`` of ``owner`` (to raise)."""
    return ValueError(f"{owner}.{name}: received {received!r}, expected {expected}")


def check_known_keys(owner: str, data: dict, cls: type) -> None:
    """Every key of ``data`` is a field of the dataclass ``cls``.

    Raises:
        ValueError: ``"<owner>: unknown keys [...]"``, sorted.
    """
    unknown = sorted(set(data) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        raise ValueError(f"{owner}: unknown keys {unknown}")


def check_int(
    owner: str, name: str, value: object, low: int | None = None, *, optional: bool = False
) -> None:
    """``value`` is an int (not a bool), ``>= low`` when ``low`` is given; with
    ``optional``, ``None`` passes too.

    Raises:
        ValueError: otherwise (see :func:`bad`).
    """
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        expected = "an int" if low is None else f"an int >= {low}"
        raise bad(owner, name, value, f"None or {expected}" if optional else expected)


def is_number(
    value: object, *, low: float = 0.0, inclusive: bool = False, finite: bool = True
) -> bool:
    """Whether ``value`` is a real number (int or float, not a bool, not NaN) ``> low``
    (``>= low`` with ``inclusive``), and finite unless ``finite`` is False."""
    return (
        not isinstance(value, bool)
        and isinstance(value, (int, float))
        and (value >= low if inclusive else value > low)
        and (not finite or math.isfinite(value))
    )


def check_number(
    owner: str,
    name: str,
    value: object,
    *,
    low: float = 0.0,
    inclusive: bool = False,
    finite: bool = True,
) -> None:
    """``value`` is a real number (int or float, not a bool, not NaN) ``> low`` (``>= low``
    with ``inclusive``), and finite unless ``finite`` is False.

    Raises:
        ValueError: otherwise (see :func:`bad`).
    """
    if not is_number(value, low=low, inclusive=inclusive, finite=finite):
        what = f"a finite number {'>=' if inclusive else '>'} {low:g}"
        raise bad(owner, name, value, what if finite else what.replace("finite ", ""))


def comma_ints(text: str) -> tuple[int, ...]:
    """A flag of comma-separated ints: ``"1,2"`` -> ``(1, 2)`` (empty parts skipped).

    Raises:
        argparse.ArgumentTypeError: a part that is not an int.
    """
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from err
