"""`finetune operator`: run the operator in a cluster (in-cluster config) or locally (a kubeconfig).

Process layout: one asyncio loop serving the HTTP endpoints (progress, /metrics, /healthz, /readyz)
from the start; once this replica holds the Lease it starts the kopf watchers, the work queue, the
progress flusher and the periodic resync. If the Lease is lost, the process exits non-zero so that
nothing acts without leadership (Kubernetes restarts it as a follower).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

from .api import failpoints

log = logging.getLogger("finetune.operator")
RELIST_POLL_SECONDS = 5.0  # how often the runner asks the cache whether a relist is due


def register(sub: Any) -> None:
    p = sub.add_parser("operator", help="run the FinetuneJob operator (kopf) against a cluster")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, then ~/.kube/config)")
    p.add_argument("--namespace", action="append", default=[], help="watch only this namespace (repeatable; default all)")
    p.add_argument("--listen", default="0.0.0.0", help="address for the HTTP endpoints")
    p.add_argument("--port", type=int, default=8080, help="port for /v1/progress, /metrics, /healthz, /readyz")
    p.add_argument("--progress-url", default=os.environ.get("FINETUNE_PROGRESS_URL"),
                   help="base URL pods use to reach this operator (e.g. http://finetune-operator.finetune-system.svc:8080)")
    p.add_argument("--tls-cert", help="serve HTTPS with this certificate")
    p.add_argument("--tls-key", help="private key for --tls-cert")
    p.add_argument("--progress-ca", help="CA certificate (PEM file) the pods trust for an https --progress-url")
    p.add_argument("--flush-interval", type=float, default=5.0, help="seconds between progress status writes per job")
    p.add_argument("--resync-interval", type=float, default=120.0, help="seconds between full re-reconciles")
    p.add_argument("--relist-interval", type=float, default=600.0,
                   help="seconds between relists of the watch cache (deletions a watch missed); 0: only after a "
                        "watch relisted")
    p.add_argument("--kuberay-timeout", type=float, default=300.0,
                   help="seconds a RayJob may wait for KubeRay's first status, or for it to act on a suspend/resume, "
                        "before its job says KubeRayReconciling=False")
    p.add_argument("--workers", type=int, default=4, help="concurrent reconciles")
    p.add_argument("--leader-elect", action=argparse.BooleanOptionalAction, default=True, help="take a Lease before acting")
    p.add_argument("--lease-namespace", default=os.environ.get("POD_NAMESPACE", "default"))
    p.add_argument("--lease-name", default="finetune-operator-leader")
    p.add_argument("--lease-duration", type=int, default=30,
                   help="seconds a leader's Lease lasts (renewed every third of it; API calls time out by then)")
    p.add_argument("--submitter-image", default=None,
                   help="image of the pod that runs `ray job submit` ({rayVersion} is replaced; default: a Ray CPU image)")
    p.add_argument("--config-namespace", default=os.environ.get("POD_NAMESPACE", "finetune-system"),
                   help="namespace of the ConfigMaps with instance-type figures and the allow-list (deploy/)")
    p.add_argument("--config-ttl", type=float, default=30.0,
                   help="seconds the instance-type figures and the allow-list read from --config-namespace are cached "
                        "(a job waiting for its instance type's figures is judged again at the next resync after that)")
    p.add_argument("--identity", default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{uuid.uuid4().hex[:6]}")
    p.add_argument("--pod-name", default=os.environ.get("POD_NAME"),
                   help="this replica's pod (in --lease-namespace): the leader labels it finetune.dev/operator-leader=true")
    p.add_argument("--log-level", default="INFO")
    p.set_defaults(func=main)


def _connection(api: Any) -> Any:
    import kopf

    cfg = api.configuration
    token = (cfg.api_key or {}).get("authorization") or (cfg.api_key or {}).get("BearerToken")
    if token and token.lower().startswith("bearer "):
        token = token[7:]
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        token=token,
        scheme="Bearer" if token else None,
    )


async def run(args: argparse.Namespace) -> int:
    import kopf
    from aiohttp import web

    from .controller import kuberay_version
    from .controller.cache import Cache
    from .controller.clusterconfig import ClusterConfig
    from .controller.handlers import build_registry, evicted, settings_for_embedding
    from .controller.k8s import FTJ, PODS, Kube, load_config
    from .controller.leader import LeaderElector, label_own_pod
    from .controller.metrics import Metrics
    from .controller.progress import ProgressServer
    from .controller.reconcile import Reconciler
    from .controller.runtime_configmaps import RUNTIMES_KEY, namespaces_with_runtimes
    from .controller.transitions import TERMINAL
    from .controller.workqueue import WorkQueue
    from .render.bundle import runtime_files
    from .render.config import RenderConfig

    api = load_config(args.kubeconfig)
    # API calls end within a third of the lease, so a call never outlives the leadership it began in.
    kube = Kube(api, timeout=min(10.0, args.lease_duration / 3))
    metrics = Metrics()
    progress_ca = Path(args.progress_ca).read_text() if args.progress_ca else None
    render_cfg = RenderConfig(progress_url=args.progress_url, progress_ca=progress_ca)
    if args.submitter_image:
        render_cfg = dataclasses.replace(render_cfg, submitter_image=args.submitter_image)
    cache = Cache(kube, namespaces=args.namespace, relist_interval=args.relist_interval)
    kube.on_written = cache.written  # a reconcile that follows its own write reads what it wrote
    kube.on_gone = cache.gone  # ... and one whose UID-guarded write found the object gone drops it
    metrics.watch_cache(cache.sizes)
    reconciler = Reconciler(kube, render_cfg, runtime_files(), metrics,
                            cluster_config=ClusterConfig(kube, args.config_namespace, ttl=args.config_ttl), cache=cache)
    reconciler.kuberay_timeout = args.kuberay_timeout
    queue = WorkQueue(reconciler.reconcile, workers=args.workers)
    reconciler.requeue_after = queue.add_after
    reconciler.requeue_rate_limited = queue.add_rate_limited
    reconciler.requeue_forget = queue.forget
    progress = ProgressServer(kube, metrics, on_flushed=queue.add, flush_interval=args.flush_interval,
                              current_cluster=lambda ns, name: reconciler.ray_clusters.get((ns, name)),
                              current_uid=lambda ns, name: reconciler.uids.get((ns, name)),
                              current_version=lambda ns, name: cache.version(FTJ, ns, name),
                              get_pod=lambda ns, name: cache.get(PODS, ns, name),
                              get_owner=lambda gvr, ns, name: cache.get(gvr, ns, name))
    metrics.queue_depth.set_function(queue.depth)

    async def check_kuberay() -> bool:
        # KubeRay's version, from its RayJob CRD (controller/kuberay_version.py): at start, and at every resync
        # until it passes (an upgrade of KubeRay clears the jobs' condition without a restart).
        ok, message = await asyncio.to_thread(kuberay_version.check, kube)
        metrics.kuberay_compatible.set(-1 if ok is None else int(ok))
        reconciler.kuberay_incompatible = message if ok is False else None
        (log.info if ok else log.error)("%s", message)
        return bool(ok)

    kuberay_ok = await check_kuberay()

    ssl_ctx = None
    reloader = None
    if args.tls_cert:
        from .controller.tls import CertificateReloader

        reloader = CertificateReloader(args.tls_cert, args.tls_key)
        ssl_ctx = reloader.context
    runner = web.AppRunner(progress.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.listen, args.port, ssl_context=ssl_ctx)
    await site.start()
    log.info("serving progress/metrics on %s:%d (%s)", args.listen, args.port, "https" if ssl_ctx else "http")
    cert_watch = asyncio.create_task(reloader.watch()) if reloader else None

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    import tracemalloc

    if tracemalloc.is_tracing():  # PYTHONTRACEMALLOC=<frames>: SIGUSR2 logs where the memory is
        loop.add_signal_handler(signal.SIGUSR2, log_memory)

    elector = None
    if args.leader_elect:
        elector = LeaderElector(kube, args.lease_namespace, args.lease_name, args.identity,
                                lease_seconds=args.lease_duration, renew_seconds=args.lease_duration / 3,
                                retry_seconds=min(5.0, args.lease_duration / 6))
        kube.may_write = elector.may_write  # fencing: no write unless the Lease surely is still ours
        progress.leader_check = elector.may_write  # ... and the flusher does not even try (no spin)
        if args.pod_name:
            await asyncio.to_thread(label_own_pod, kube, args.lease_namespace, args.pod_name, False)
        acquire = asyncio.create_task(elector.acquire())
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({acquire, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if stop.is_set():
            acquire.cancel()
            await runner.cleanup()
            return 0
    progress.ready = True
    metrics.leader.set(1)
    # Silence toward a stall counts from now on only: an outage of the operator is not the training's.
    reconciler.watching_since = reconciler.clock()
    reconciler.held_report = progress.held_report
    if elector and args.pod_name:
        await asyncio.to_thread(label_own_pod, kube, args.lease_namespace, args.pod_name, True)

    registry = build_registry(queue, reconciler, progress, cache)

    @kopf.on.login(registry=registry)
    def login(**_: Any) -> Any:
        return _connection(api)

    queue.start()

    async def collect_runtimes_after_start() -> None:
        # Jobs deleted while no operator ran left their runtime ConfigMaps behind: look once, when the
        # watches have filled the cache (controller/runtime_configmaps.py).
        await asyncio.sleep(30)
        try:
            found = await asyncio.to_thread(namespaces_with_runtimes, kube, args.namespace or None)
        except Exception as err:  # the next deletion in a namespace collects it anyway
            log.warning("could not list runtime ConfigMaps: %s", err)
            return
        for ns in sorted(found):
            queue.add(ns, RUNTIMES_KEY)

    async def resync() -> None:
        nonlocal kuberay_ok
        while True:
            await asyncio.sleep(args.resync_interval)
            if not kuberay_ok:
                kuberay_ok = await check_kuberay()
            for (ns, name), phase in list(reconciler.phases.items()):
                if phase not in TERMINAL:  # finished jobs change only through events (delete, edit)
                    queue.add(ns, name)

    on_evicted = evicted(queue, reconciler, progress)

    async def relist() -> None:
        # The watch cache's relists (controller/cache.py): after a watch relisted, and periodically.
        while True:
            await asyncio.sleep(RELIST_POLL_SECONDS)
            for gvr in cache.relists_due():
                try:
                    gone = await asyncio.to_thread(cache.relist, gvr)
                except Exception as err:  # tried again at the next look
                    log.warning("could not relist %s: %s", gvr[2], err)
                    continue
                for obj in gone:
                    on_evicted(gvr, obj)

    kopf_stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = [
        asyncio.create_task(
            kopf.operator(
                registry=registry,
                settings=settings_for_embedding(),
                clusterwide=not args.namespace,
                namespaces=args.namespace,
                stop_flag=kopf_stop,
                # kopf's own identity otherwise comes from getpass.getuser(), which fails ("No username set
                # in the environment") for a uid without a passwd entry: the image runs as 10001.
                identity=args.identity,
            ),
            name="kopf",
        ),
        asyncio.create_task(progress.flush_forever(), name="flush"),
        asyncio.create_task(resync(), name="resync"),
        asyncio.create_task(relist(), name="relist"),
    ]
    # Not among `tasks`: it ends after one look, which must not end the operator.
    collector = asyncio.create_task(collect_runtimes_after_start(), name="collect-runtimes")
    waiters: list[asyncio.Task[Any]] = [asyncio.create_task(stop.wait())]
    if elector:
        waiters.append(asyncio.create_task(elector.hold()))
    done, _ = await asyncio.wait(waiters + tasks, return_when=asyncio.FIRST_COMPLETED)
    lost = elector is not None and not elector.is_leader and not stop.is_set()
    kopf_stop.set()
    progress.ready = False
    metrics.leader.set(0)
    if not lost:  # a deposed leader writes nothing more, not even its last progress
        await asyncio.to_thread(progress.flush_once)
    collector.cancel()
    for t in tasks + waiters:
        if t.get_name() != "kopf":
            t.cancel()
    await asyncio.wait(tasks, timeout=10)
    await queue.stop()
    if elector and not lost:
        await asyncio.to_thread(elector.release)
    if cert_watch:
        cert_watch.cancel()
    await runner.cleanup()
    for t in done:
        if t in tasks and not t.cancelled() and t.exception():
            log.error("%s stopped: %s", t.get_name(), t.exception())
            return 1
    if lost:
        log.error("leadership lost: exiting so that only the leader acts")
        return 2
    return 0


def log_memory(top: int = 25) -> None:
    """The allocation sites holding the most memory now (a diagnostic: run with PYTHONTRACEMALLOC=<frames>
    and send SIGUSR2)."""
    import tracemalloc

    snap = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
    stats = snap.statistics("traceback")
    total = sum(st.size for st in stats)
    lines = [f"traced memory {total / 2**20:.1f} MiB in {len(stats)} sites; the top {top}:"]
    for st in stats[:top]:
        lines.append(f"  {st.size / 2**20:8.2f} MiB {st.count:8d} blocks")
        lines.extend(f"      {frame}" for frame in st.traceback.format()[-8:])
    log.warning("\n".join(lines))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("kopf").setLevel(logging.WARNING)
    try:
        failpoints.arm_from_env()  # armed: one WARNING now; a bad value stops the start here, in one line
    except failpoints.FailpointSpecError as err:
        log.error("%s", err)
        return 2
    return asyncio.run(run(args))
