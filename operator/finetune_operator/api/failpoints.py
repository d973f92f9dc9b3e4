"""Named fail points: where tests make shipped code fail at an exact moment (etcd's gofail is the model).

A point is one call, ``failpoint("reconcile/after-create")``, at the place the fault belongs. Every point is
registered in :data:`POINTS` with what it interrupts; a call with an unregistered name is a programming
error. Points are inert unless armed, and they are armed only through one environment variable::

    FINETUNE_FAILPOINTS="reconcile/after-create=exit(137);train/after-step=exit(17)@step=5,rank=1"

``;`` separates points; each is ``NAME=ACTION[@KEY=VALUE,...]``:

- ``exit(N)``: end the process at once with status N (``os._exit``: no cleanup, like a SIGKILL).
- ``raise``: raise :class:`FailpointError` at the point.
- ``sleep(S)``: pause S seconds (float), then carry on.

``@KEY=VALUE`` conditions fire the action only when the point's call passes those values (compared as
strings): ``failpoint("train/after-step", step=5, rank=1)``. A point that passes ``once=<path>`` fires at
most once across processes: the file is written just before the action, and an existing one disarms it
(what a crash-and-restart test needs: the restarted process must get past the point).

An unknown point name, an unknown action or a malformed term is refused with an error naming it, when the
variable is first read (the process starts, or the first point is reached). An armed process logs one
WARNING naming every armed point. Standard library only: this module ships to the Ray pods with the API.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

ENV = "FINETUNE_FAILPOINTS"

# name -> where it interrupts (the documentation of every point; docs/operator.md, docs/training.md)
POINTS: dict[str, str] = {
    "reconcile/after-create": "the operator created a job's children, before the status write that records "
                              "the RayJob's UID (controller/reconcile.py)",
    "train/after-step": "a training rank finished an optimizer step (finetune_training/loop.py); "
                        "passes step, rank",
}

log = logging.getLogger("finetune.failpoints")

_TERM = re.compile(r"^(?P<name>[a-z0-9/_-]+)=(?P<action>[a-z]+)(?:\((?P<arg>[^()]*)\))?(?:@(?P<when>.+))?$")


class FailpointError(Exception):
    """Raised by a point armed with ``raise``."""


class FailpointSpecError(ValueError):
    """The FINETUNE_FAILPOINTS value names an unknown point or action, or is malformed."""


@dataclass(frozen=True)
class Armed:
    action: str  # exit | raise | sleep
    arg: float = 0.0
    when: dict[str, str] = field(default_factory=dict)


def parse(spec: str) -> dict[str, Armed]:
    """``FINETUNE_FAILPOINTS``'s value -> the armed points; FailpointSpecError on anything unknown."""
    armed: dict[str, Armed] = {}
    for term in (t.strip() for t in spec.split(";")):
        if not term:
            continue
        m = _TERM.match(term)
        if not m:
            raise FailpointSpecError(f"{ENV}: {term!r} is not NAME=ACTION[@KEY=VALUE,...]")
        name, action, arg = m["name"], m["action"], m["arg"]
        if name not in POINTS:
            raise FailpointSpecError(f"{ENV}: unknown fail point {name!r}; known: {', '.join(sorted(POINTS))}")
        if name in armed:
            raise FailpointSpecError(f"{ENV}: fail point {name!r} armed twice")
        if action == "raise" and arg is None:
            value = 0.0
        elif action in ("exit", "sleep") and arg is not None:
            try:
                value = float(arg) if action == "sleep" else int(arg)
            except ValueError:
                raise FailpointSpecError(f"{ENV}: {term!r}: {action}() takes a number, not {arg!r}") from None
        else:
            raise FailpointSpecError(f"{ENV}: {term!r}: unknown action; use exit(N), raise or sleep(SECONDS)")
        when: dict[str, str] = {}
        for cond in (m["when"] or "").split(","):
            if not m["when"]:
                break
            key, sep, val = cond.partition("=")
            if not sep or not key.strip() or not val.strip():
                raise FailpointSpecError(f"{ENV}: {term!r}: condition {cond!r} is not KEY=VALUE")
            when[key.strip()] = val.strip()
        armed[name] = Armed(action, value, when)
    return armed


_armed: dict[str, Armed] | None = None


def arm_from_env() -> dict[str, Armed]:
    """Read FINETUNE_FAILPOINTS once per process (again after :func:`reset`); logs a WARNING when armed."""
    global _armed
    if _armed is None:
        spec = os.environ.get(ENV, "")
        _armed = parse(spec)
        if _armed:
            log.warning("FAIL POINTS ARMED (%s=%r): this process will fail on purpose at %s; never set it in "
                        "production", ENV, spec, ", ".join(sorted(_armed)))
    return _armed


def reset() -> None:
    """Forget what was read, so the next point reads the variable again (for tests)."""
    global _armed
    _armed = None


def failpoint(name: str, *, once: Path | None = None, **context: object) -> None:
    """The point ``name``: nothing unless FINETUNE_FAILPOINTS arms it (and its conditions match ``context``)."""
    if name not in POINTS:
        raise KeyError(f"fail point {name!r} is not registered in finetune_operator.api.failpoints.POINTS")
    armed = arm_from_env().get(name)
    if armed is None or any(str(context.get(k)) != v for k, v in armed.when.items()):
        return
    if once is not None:
        if once.exists():
            return
        once.parent.mkdir(parents=True, exist_ok=True)
        once.write_text(f"{ENV}: {name}\n")
    detail = ", ".join(f"{k}={v}" for k, v in context.items())
    message = f"fail point {name} ({detail}): {armed.action}" + (f"({armed.arg:g})" if armed.action != "raise" else "")
    log.warning(message)
    print(message, flush=True)  # Ray Train workers' logging may not reach the driver; stdout does
    if armed.action == "exit":
        os._exit(int(armed.arg))
    if armed.action == "sleep":
        time.sleep(armed.arg)
        return
    raise FailpointError(message)
