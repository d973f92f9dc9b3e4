"""The versions the runtime supports, checked before anything heavy is imported.

The runtime ships as source into an image it does not build (by default the AWS Ray Train DLC, whose
Python stack is pinned in ``requirements/dlc.txt``). A Python, Ray, torch, transformers or pydantic outside
the tested range would otherwise fail deep inside a worker with an AttributeError; this turns it into one
line at start naming the package, the version found and the range supported.

The ranges span the two stacks the tests run on: the DLC's (``requirements/dlc.txt``) and the project's own
pins (``requirements/constraints.txt``); ``tests/training/test_stackcheck.py`` keeps them in agreement.
Upper bounds are the next untested minor (major for pydantic/transformers, which keep their APIs within one):
widen a range only together with the pins that test it.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata

Version = tuple[int, ...]


@dataclass(frozen=True)
class Supported:
    """``minimum <= version < below``, compared on the numeric release parts (``2.13.0+cu130`` is 2.13.0)."""

    minimum: str
    below: str

    def contains(self, version: str) -> bool:
        v = parse(version)
        return parse(self.minimum) <= v < parse(self.below)

    def __str__(self) -> str:
        return f">={self.minimum},<{self.below}"


SUPPORTED: dict[str, Supported] = {
    "python": Supported("3.11", "3.14"),
    "ray": Supported("2.58.0", "2.61"),
    "torch": Supported("2.13.0", "2.16"),
    "transformers": Supported("5.13.0", "6"),
    "pydantic": Supported("2.10", "3"),
}


class UnsupportedStack(RuntimeError):
    """A package is missing or outside its supported range; the message is the one line to show."""


def parse(version: str) -> Version:
    """The leading numeric release of a version string: ``"2.13.0+cu130"`` -> ``(2, 13, 0)``; trailing zeros
    dropped so that ``"3"`` and ``"3.0.0"`` compare equal."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    if not m:
        raise ValueError(f"not a version: {version!r}")
    parts = [int(p) for p in m.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _installed(name: str) -> str | None:
    if name == "python":
        return ".".join(str(p) for p in sys.version_info[:3])
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def check(found: Mapping[str, str | None] | None = None,
          supported: Mapping[str, Supported] = SUPPORTED,
          installed: Callable[[str], str | None] = _installed) -> dict[str, str]:
    """Raise :class:`UnsupportedStack` for the first package missing or out of range; return what was found.

    ``found`` overrides what is looked up (a test feeds versions this way); a package it lacks is looked
    up with ``installed`` (installed distribution metadata: no package is imported).
    """
    out: dict[str, str] = {}
    for name, rng in supported.items():
        version = found[name] if found is not None and name in found else installed(name)
        if version is None:
            raise UnsupportedStack(f"{name} is not installed; the training runtime needs {name}{rng}")
        if not rng.contains(version):
            raise UnsupportedStack(f"{name} {version} is not supported by the training runtime (supported: {rng})")
        out[name] = version
    return out


def describe(found: Mapping[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in found.items())
