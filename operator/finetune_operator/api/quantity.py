"""Kubernetes resource quantities ("40", "500m", "160Gi", "1e3") as exact numbers."""

from __future__ import annotations

import re
from fractions import Fraction

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL: dict[str, Fraction] = {
    "n": Fraction(1, 10**9), "u": Fraction(1, 10**6), "m": Fraction(1, 1000), "": Fraction(1),
    "k": Fraction(10**3), "M": Fraction(10**6), "G": Fraction(10**9), "T": Fraction(10**12),
    "P": Fraction(10**15), "E": Fraction(10**18),
}
_RE = re.compile(r"^(?P<num>[+]?(\d+(\.\d*)?|\.\d+))(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?\d+)?$")


def parse(q: str) -> Fraction:
    """Parse a quantity; raises ValueError with the offending text."""
    m = _RE.match(q.strip())
    if not m:
        raise ValueError(f"{q!r} is not a Kubernetes quantity (e.g. 40, 500m, 160Gi)")
    num = Fraction(m.group("num"))
    suffix = m.group("suffix") or ""
    if suffix in _BINARY:
        return num * _BINARY[suffix]
    if suffix in _DECIMAL:
        return num * _DECIMAL[suffix]
    return num * Fraction(10) ** int(suffix[1:])


def gib(q: str) -> float:
    return float(parse(q) / 2**30)


def fmt_gi(value_gib: float) -> str:
    """Whole GiB when exact, else MiB."""
    mib = round(value_gib * 1024)
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"
