"""A flood of forged progress reports beside genuine ones (used by the integration test, scaled down,
and by benchmarks/bench_progress_flood.py at full size).

Forged requests carry fresh, plausible-looking tokens (JWT shape, a real job's audience, not expired),
so every one of them would cost a TokenReview without the endpoint's defences. Genuine reporters post
with the pod-bound, job-audience tokens the kubelet would mount. Meanwhile the Lease is sampled: the
leader must keep renewing it.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class FloodResult:
    forged: Counter[int] = field(default_factory=Counter)
    genuine: Counter[int] = field(default_factory=Counter)
    genuine_sent: int = 0
    forged_sent: int = 0
    forged_latency: list[float] = field(default_factory=list)
    genuine_latency: list[float] = field(default_factory=list)
    seconds: float = 0.0
    last_step: dict[str, int] = field(default_factory=dict)


def forged_token(audience: str) -> str:
    def seg(obj: dict[str, Any]) -> str:
        return base64.urlsafe_b64encode(json.dumps(obj).encode()).decode().rstrip("=")

    claims = {"aud": [audience], "exp": int(time.time()) + 3600, "iss": "https://kubernetes.default.svc",
              "sub": f"system:serviceaccount:x:{random.getrandbits(64):x}"}
    return f"{seg({'alg': 'RS256', 'kid': 'forged'})}.{seg(claims)}.{seg({'sig': random.getrandbits(128)})}"


async def _post(session: aiohttp.ClientSession, url: str, token: str, body: dict[str, Any]) -> tuple[int, float]:
    started = time.monotonic()
    try:
        async with session.post(url, json=body, headers={"Authorization": f"Bearer {token}"}) as resp:
            await resp.read()
            return resp.status, time.monotonic() - started
    except (TimeoutError, aiohttp.ClientError):
        return 0, time.monotonic() - started


async def flood(base_url: str, jobs: list[tuple[str, str, str]], forged_per_second: float, seconds: float,
                report_interval: float = 1.0, concurrency: int = 256,
                genuine_address: str = "127.0.0.2") -> FloodResult:
    """`jobs`: (namespace, name, genuine token). Returns response codes of both kinds. The genuine
    reporters connect from another loopback address, as pods have addresses of their own."""
    result = FloodResult()
    limit = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=30)
    connector = aiohttp.TCPConnector(limit=concurrency)
    genuine_connector = aiohttp.TCPConnector(limit=len(jobs) + 1, local_addr=(genuine_address, 0))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session, \
            aiohttp.ClientSession(timeout=timeout, connector=genuine_connector) as genuine:
        deadline = time.monotonic() + seconds

        async def forged_one() -> None:
            ns, name, _ = random.choice(jobs)
            async with limit:
                code, took = await _post(session, f"{base_url}/v1/progress/{ns}/{name}",
                                         forged_token(f"finetune.dev/progress/{ns}/{name}"),
                                         {"rank": 0, "training": {"step": 999999, "loss": 0.0}})
            result.forged[code] += 1
            result.forged_latency.append(took)

        async def forger() -> None:
            tasks: set[asyncio.Task[None]] = set()
            start = time.monotonic()
            while time.monotonic() < deadline:
                due = int((time.monotonic() - start) * forged_per_second) - result.forged_sent
                for _ in range(max(0, due)):
                    result.forged_sent += 1
                    task = asyncio.create_task(forged_one())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await asyncio.sleep(0.005)
            if tasks:
                await asyncio.wait(tasks)

        async def reporter(ns: str, name: str, token: str) -> None:
            step = 0
            while time.monotonic() < deadline:
                step += 1
                result.genuine_sent += 1
                code, took = await _post(genuine, f"{base_url}/v1/progress/{ns}/{name}", token,
                                         {"rank": 0, "training": {"step": step, "totalSteps": 100000, "loss": 1.0}})
                result.genuine[code] += 1
                result.genuine_latency.append(took)
                if code == 202:
                    result.last_step[f"{ns}/{name}"] = step
                await asyncio.sleep(report_interval)

        started = time.monotonic()
        await asyncio.gather(forger(), *(reporter(*j) for j in jobs))
        result.seconds = time.monotonic() - started
    return result


def lease_sampler(read_lease: Any, stop: Any, samples: list[tuple[float, str, str]], every: float = 1.0) -> None:
    """Thread body: (time, holder, renewTime) of the leader Lease every `every` seconds until `stop`."""
    while not stop.is_set():
        lease = read_lease()
        samples.append((time.monotonic(), str(lease.spec.holder_identity), str(lease.spec.renew_time)))
        stop.wait(every)
