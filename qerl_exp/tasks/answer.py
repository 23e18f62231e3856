r"""Answer comparison: exact for numbers, symbolic (math-verify) for LaTeX expressions.

`answers_equal(predicted, reference)` is the one entry point the correctness reward uses.

- A numeric reference (`18`, `1,250`, `-3/4`, `\frac{3}{4}`, `0.5`, `\boxed{18}`) needs a
  numeric prediction with the same exact value (rationals, no float tolerance): `$1,250.00`,
  `1250 apples.`, `x = 1250` and `\boxed{1250}` all equal `1250`; `19` never equals `18`, and a
  hedge such as `18 or 19` is not a number at all. We do not hand numeric references to
  math-verify, because it evaluates expressions: it would accept `12+3` for `15`, which on
  `task=arith` is the question copied back, not an answer.
- Any other reference (`\sqrt{2}`, `x^2+1`, `(1,2)`, `2\frac{1}{2}`, `\text{Monday}`) is
  compared by math-verify (the verifier of the paper's BigMath reward), and by normalized text
  when math-verify cannot parse one side (plain words such as `Monday`).

Units and currency are ignored, not converted: `5 cm` equals `5`, and so does `5 m`.

Every parse ends in bounded time, whatever the text (a data file's reference, a model's reply): an
answer of more than `MAX_ANSWER_CHARS` characters, or whose exact value would need more than
`MAX_DIGITS` digits (`1e999999999`), is not a number.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction

# A plain decimal, e.g. `12`, `-0.5`, `.5`, `3.`, `1e3` (no thousands separators).
_DECIMAL = r"(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
# Thousands separated by commas, e.g. `1,250` or `12,345.6`; `1,25` is not a number.
_THOUSANDS = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?"
_FRAC = re.compile(rf"\\[dt]?frac\{{\s*([-+]?{_DECIMAL})\s*\}}\{{\s*([-+]?{_DECIMAL})\s*\}}|\\[dt]?frac(\d)(\d)")
_SLASH = re.compile(rf"([-+]?{_DECIMAL})\s*/\s*([-+]?{_DECIMAL})")
# sign, currency (either side of the sign), the number, then an optional unit of words.
_NUMBER = re.compile(
    rf"""^(?P<sign>[-+]?)\s*(?:[$€£¥]|usd)?\s*(?P<sign2>[-+]?)\s*
    (?P<num>{_THOUSANDS}|{_DECIMAL}|{_SLASH.pattern}|{_FRAC.pattern})
    \s*(?P<unit>%|(?:[A-Za-z]{{2,}}|(?<=\s)[mgslLhK]\b)(?:[\s./-]+[A-Za-z]+)*\.?)?$""",
    re.VERBOSE | re.IGNORECASE,
)
# Words that make "18 and a half" or "2 million" more than a number followed by a unit.
_NOT_UNITS = {
    "and", "or", "plus", "minus", "times", "point", "half", "halves", "quarter", "quarters", "third",
    "thirds", "dozen", "hundred", "thousand", "million", "billion", "trillion", "to", "over",
}
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|textrm|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}")
_ASSIGNMENT = re.compile(r"^[A-Za-z]\w*\s*=\s*(?=[^=])")
_PREAMBLE = re.compile(r"^(?:the\s+)?(?:final\s+)?answer\s*(?:is|:)\s*", re.IGNORECASE)
# Bounds that keep every parse fast: no one number is written longer, or has more digits.
MAX_ANSWER_CHARS = 500
MAX_DIGITS = 1000


def last_boxed(text: str) -> str | None:
    r"""The content of the last `\boxed{...}` (or `\fbox{...}`) in `text`, braces balanced.

    Args:
        text: any text, e.g. a MATH solution.

    Returns:
        The content with surrounding whitespace stripped, `\boxed 5` giving `5`; None when there
        is no box or its braces never close.

    Example:
        >>> last_boxed(r"so $x = \boxed{\frac{1}{2}}$.")
        '\\frac{1}{2}'
    """
    boxes = list(re.finditer(r"\\(?:boxed|fbox)", text))
    if not boxes:
        return None
    rest = text[boxes[-1].end():]
    if not rest.startswith("{"):
        bare = re.match(r"\s+([^\s$]+)", rest)  # `\boxed 5`
        return bare.group(1) if bare else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:i].strip()
    return None


def _strip_math_markup(text: str) -> str:
    """Remove what wraps or decorates an answer without changing its value."""
    s = text.strip().replace("\u2212", "-").replace("\u2009", "").replace("\u00a0", " ")
    boxed = last_boxed(s)
    if boxed is not None:
        s = boxed
    for left, right in (("$$", "$$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if s.startswith(left) and s.endswith(right) and len(s) >= len(left) + len(right):
            s = s[len(left):len(s) - len(right)].strip()
    if s.count("$") == 2 and s.startswith("$") and s.endswith("$"):
        s = s[1:-1].strip()  # inline math `$...$`; a lone `$` is currency and stays
    s = re.sub(r"\\left|\\right|\\displaystyle|\\[,;:! ]", "", s.replace("{,}", ","))  # LaTeX spacing
    s = _TEXT_WRAPPERS.sub(r" \1 ", s)
    s = s.replace("\\%", "%").replace("\\$", "$")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?|°", "", s)
    # A trailing full stop ends the sentence; `3.` as a decimal has the same value without it.
    return s.strip().rstrip(".!。").strip()


def parse_number(text: str) -> Fraction | None:
    r"""The exact value of an answer that is one number, else None.

    Handles signs (`-5`, `−5`, `+5`), thousands separators (`1,250`, `1{,}250`), decimals
    (`0.50`, `.5`, `5.`), fractions (`3/4`, `\frac{3}{4}`, `\dfrac34`), currency (`$18`, `\$18`,
    `-$5`), units and percent signs (`18 apples`, `25%`, `30^\circ`, `5\text{ cm}`), a trailing
    period, an assignment (`x = 5`), math delimiters and `\boxed{}`.

    Args:
        text: the answer text, e.g. the content of `<answer>...</answer>`.

    Returns:
        A `Fraction` (so `0.1 + 0.2` style rounding never makes two answers equal), or None when
        the text is not exactly one number (`18 or 19`, `2 million`, `\sqrt{2}`, `1,25`, `1e999999999`).

    Example:
        >>> parse_number("$1,250.00")
        Fraction(1250, 1)
        >>> parse_number("18 or 19") is None
        True
    """
    if len(text) > MAX_ANSWER_CHARS:
        return None
    s = _ASSIGNMENT.sub("", _PREAMBLE.sub("", re.sub(r"\s+", " ", _strip_math_markup(text))))
    if len(s) > 2 and s[0] == "(" and s[-1] == ")":
        s = s[1:-1].strip()
    m = _NUMBER.match(s)
    if m is None:
        return None
    if m.group("unit") and set(re.findall(r"[a-z]+", m.group("unit").lower())) & _NOT_UNITS:
        return None
    if m.group("sign") and m.group("sign2"):
        return None  # `-$-5`
    value = _value(m.group("num"))
    if value is None:
        return None
    return -value if "-" in (m.group("sign") + m.group("sign2")) else value


def _exact(text: str) -> Fraction:
    """`Fraction(text)`, refused (ValueError) when its exponent would make it more than `MAX_DIGITS`
    digits long: `Fraction("1e999999999")` builds 10**999999999 and never returns."""
    exponent = re.search(r"[eE]([-+]?\d+)$", text)
    if exponent and (len(exponent.group(1)) > 6 or abs(int(exponent.group(1))) > MAX_DIGITS):
        raise ValueError(f"{text} has more than {MAX_DIGITS} digits")
    return Fraction(text)


def _value(num: str) -> Fraction | None:
    try:
        frac = _FRAC.fullmatch(num)
        if frac:
            top, bottom = (frac.group(1), frac.group(2)) if frac.group(1) is not None else (frac.group(3), frac.group(4))
            return _exact(top) / _exact(bottom)
        slash = _SLASH.fullmatch(num)
        if slash:
            return _exact(slash.group(1)) / _exact(slash.group(2))
        return _exact(num.replace(",", "").rstrip("."))
    except (ValueError, ZeroDivisionError):
        return None


def _normalize_text(text: str) -> str:
    s = _strip_math_markup(text).replace("$", "")
    return re.sub(r"\s+", " ", s).strip().casefold()


def _symbolic_equal(predicted: str, reference: str) -> bool | None:
    """math-verify's verdict, or None when it cannot parse one side."""
    from math_verify import parse, verify

    # math-verify times out with signal.alarm, which only works on the main thread; elsewhere
    # (e.g. a reward computed in a worker thread) it must run without a timeout.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

    def parsed(text: str):
        inner = _strip_math_markup(text).replace("\\$", "")
        return parse(f"\\boxed{{{inner}}}", parsing_timeout=timeout)

    gold, pred = parsed(reference), parsed(predicted)
    if not gold or not pred:
        return None
    return bool(verify(gold, pred, timeout_seconds=timeout))


def answers_equal(predicted: str, reference: str) -> bool:
    r"""Whether a predicted answer is the reference answer.

    Args:
        predicted: the model's answer (the content of its `<answer>` tags).
        reference: the data set's answer.

    Returns:
        For a numeric reference: whether `predicted` is one number of exactly the same value.
        Otherwise: whether the normalized texts match or math-verify finds them equivalent.

    Example:
        >>> answers_equal("$18.00", "18"), answers_equal("19", "18"), answers_equal("12+3", "15")
        (True, False, False)
        >>> answers_equal(r"\frac{\sqrt{2}}{2}", r"\frac{1}{\sqrt{2}}")
        True
    """
    expected = parse_number(reference)
    if expected is not None:
        return parse_number(predicted) == expected
    if _normalize_text(predicted) == _normalize_text(reference):
        return True
    # math-verify's time grows with the text; an answer this long is no expression of one value
    return max(len(predicted), len(reference)) <= MAX_ANSWER_CHARS and bool(_symbolic_equal(predicted, reference))
