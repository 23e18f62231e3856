"""Answer comparison: numeric and exact."""

from __future__ import annotations

from fractions import Fraction


def _number(text: str) -> Fraction | None:
    text = text.strip().replace(",", "").rstrip(".")
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def answers_equal(predicted: str, reference: str) -> bool:
    """True when both parse to the same number, else when the stripped strings match."""
    a, b = _number(predicted), _number(reference)
    if a is not None and b is not None:
        return a == b
    return predicted.strip() == reference.strip()
