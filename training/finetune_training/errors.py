"""Failures that a restart repeats, and how to recognise one after Ray Train has wrapped it.

Ray Train restarts the worker group after any worker error, up to `FailureConfig.max_failures`. For a
non-finite loss, bad data, an unusable resume checkpoint, uneven HSDP ranks, a storage URI that cannot be
read, or requireEFA without EFA, every restart fails the same way: the job only takes longer to fail and
spends the restarts a real fault (a killed pod) would need. Those errors derive from `DeterministicError`;
the driver's `failfast.FailFast` callback stops the run at the first one (see `failfast`).
"""

from __future__ import annotations


class DeterministicError(Exception):
    """A failure that recurs on every restart with the same inputs: the job fails at once."""


def deterministic_cause(error: BaseException | None) -> DeterministicError | None:
    """The DeterministicError in `error`, looking through Ray Train's wrappers (the worker's exception is
    carried as `_base_exc` of `UserExceptionWithTraceback`, or as a cause); None if there is none."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, DeterministicError):
            return error
        seen.add(id(error))
        error = getattr(error, "_base_exc", None) or getattr(error, "cause", None) or error.__cause__
    return None
