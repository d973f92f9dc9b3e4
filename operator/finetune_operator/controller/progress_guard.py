"""Defences of the progress endpoint against floods of forged tokens. Pure (clock passed in).

Every unknown token costs a TokenReview (one API request, or two for a token of another job). A flood of
forged tokens must not turn into a flood of TokenReviews, fill memory, or starve the thread that renews
the leader Lease. So:
- verdicts are cached in bounded LRU maps with a TTL: accepted tokens (60 s) and rejected ones (30 s),
  so a repeated forged token costs nothing after the first time;
- tokens that cannot be service-account JWTs (not three segments, expired, no job audience) are
  rejected without asking the API server;
- TokenReviews are rate-limited per client address (the source of the connection: behind a Service
  that is the pod's IP) and overall (token buckets); over the limit the answer is 429 with Retry-After.
  Genuine pods' tokens are cached after their first report, but each is reviewed again when its verdict
  expires, and those re-verifications must not compete with a flood on equal terms: the last
  `reserved_share` of the overall bucket goes only to a *quiet* source, one that has had no
  TokenReview for `quiet_seconds`. A source that floods (many addresses at once, each within its own
  budget, included) takes at most the overall budget above the reserve, and a quiet source's review
  goes first as the bucket refills. (Only a flood from more addresses than the overall rate times
  `quiet_seconds`, each asking once per `quiet_seconds`, could still take the reserve.)
"""

from __future__ import annotations

import base64
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

V = TypeVar("V")


class TTLCache(Generic[V]):
    """A bounded map whose entries expire; the least recently used entry goes first when full."""

    def __init__(self, max_entries: int, clock: Callable[[], float] = time.monotonic):
        self.max_entries = max_entries
        self.clock = clock
        self._items: OrderedDict[str, tuple[float, V]] = OrderedDict()
        self.evictions = 0

    def get(self, key: str) -> V | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        if hit[0] <= self.clock():
            del self._items[key]
            return None
        self._items.move_to_end(key)
        return hit[1]

    def put(self, key: str, value: V, ttl: float) -> None:
        self._items[key] = (self.clock() + ttl, value)
        self._items.move_to_end(key)
        while len(self._items) > self.max_entries:
            self._items.popitem(last=False)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._items)


class TokenBucket:
    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic):
        self.rate = rate
        self.burst = burst
        self.clock = clock
        self.tokens = burst
        self.updated = clock()

    def take(self, keep: float = 0.0) -> bool:
        """One token, if more than `keep` would be left of the bucket (a reserve the caller guards)."""
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1 + keep:
            self.tokens -= 1
            return True
        return False


@dataclass(frozen=True)
class Limits:
    reviews_per_second: float = 50.0  # TokenReviews overall
    reviews_burst: float = 100.0
    client_reviews_per_second: float = 5.0  # TokenReviews per client address
    client_reviews_burst: float = 20.0
    # The last `reserved_share` of the overall burst goes only to a source that had no review for
    # `quiet_seconds` (a genuine pod re-verifies once per token per `accepted_ttl`).
    reserved_share: float = 0.2
    quiet_seconds: float = 10.0
    max_clients: int = 4096
    accepted_ttl: float = 60.0
    rejected_ttl: float = 30.0
    max_cached: int = 10000


class ReviewLimiter:
    """Per-client token buckets for TokenReviews under an overall one whose last tokens are reserved for
    quiet clients (see the module doc); a bounded number of clients."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic):
        self.limits = limits
        self.clock = clock
        self.overall = TokenBucket(limits.reviews_per_second, limits.reviews_burst, clock)
        self.clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self.last_review: dict[str, float] = {}  # per client in `clients`: when its last review was allowed
        self.reserve = limits.reserved_share * limits.reviews_burst
        self.refused = 0

    def allow(self, client: str) -> bool:
        bucket = self.clients.get(client)
        if bucket is None:
            bucket = TokenBucket(self.limits.client_reviews_per_second, self.limits.client_reviews_burst, self.clock)
            self.clients[client] = bucket
            while len(self.clients) > self.limits.max_clients:
                gone, _ = self.clients.popitem(last=False)
                self.last_review.pop(gone, None)
        self.clients.move_to_end(client)
        last = self.last_review.get(client)
        quiet = last is None or self.clock() - last >= self.limits.quiet_seconds
        ok = bucket.take() and self.overall.take(keep=0.0 if quiet else self.reserve)
        if ok:
            self.last_review[client] = self.clock()
        else:
            self.refused += 1
        return ok


def implausible(token: str, now: float) -> str | None:
    """Why `token` cannot be a live service-account token (unverified claims), or None. A cheap filter
    before the TokenReview: forging a plausible token costs an attacker nothing, but it keeps random
    garbage from reaching the API server."""
    parts = token.split(".")
    if len(parts) != 3 or not all(parts):
        return "not a JWT"
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except ValueError:
        return "not a JWT"
    if not isinstance(claims, dict):
        return "not a JWT"
    exp = claims.get("exp")
    if isinstance(exp, int | float) and exp < now:
        return "token expired"
    aud = claims.get("aud")
    auds = [aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []
    if not any(isinstance(a, str) and a.startswith("finetune.dev/progress/") for a in auds):
        return "token has no finetune.dev/progress audience"
    return None
