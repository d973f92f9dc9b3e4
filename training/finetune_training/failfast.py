"""Fail fast on deterministic errors: a Ray Train 2.x controller callback (imports Ray; driver only).

How Ray Train v2 decides (ray/train/v2/_internal/execution/failure_handling/default.py): a worker error
reaches the controller's `DefaultFailurePolicy` as a `WorkerGroupError`, which is always retryable and
counted against `FailureConfig.max_failures`; a `ControllerError` is retried only when it is a worker-group
startup failure. The policy itself cannot be replaced (`create_failure_policy` has no hook), but the
controller runs `UserCallback.after_exception(run_context, worker_exceptions)` when it polls a worker group
with errors, before the policy decides, and an exception from a callback becomes a `ControllerError`
that the policy RAISEs. So `FailFast` raises `DeterministicFailure` when a worker failed with a
`errors.DeterministicError`: the run fails once, with that error's message, instead of max_failures + 1
times. Any other worker error (a killed pod, NCCL) returns and is retried as before.
"""

from __future__ import annotations

from typing import Any

from ray.train import UserCallback

from .errors import deterministic_cause


class DeterministicFailure(RuntimeError):
    """Raised on the controller to stop retries; its message is the worker's (`rank N: Type: message`)."""


class FailFast(UserCallback):
    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        for rank, error in sorted(worker_exceptions.items()):
            cause = deterministic_cause(error)
            if cause is not None:
                raise DeterministicFailure(f"rank {rank}: {type(cause).__name__}: {cause} "
                                           "(deterministic: not retried)")


def failure_message(error: BaseException) -> str:
    """What the driver's status says for `trainer.fit()`'s exception: the deterministic error as the worker
    raised it (`rank 0: NonFiniteError: step 1: ...`), else the exception's type and text."""
    inner = getattr(error, "controller_failure", None)  # ray.train.ControllerError
    if isinstance(inner, DeterministicFailure):
        return str(inner)
    return f"{type(error).__name__}: {error}"
