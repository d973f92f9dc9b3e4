"""``finetune dev-cluster up | down | status | kubeconfig | build``.

The main CLI calls :func:`register` with its subparsers; ``python -m finetune_devcluster.cli``
runs the same commands standalone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import build
from .cluster import DevCluster, DevClusterError, default_workdir


def register(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:  # type: ignore[type-arg]
    """Add the ``dev-cluster`` command; it sets ``func`` (``func(args) -> int``) on the namespace."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "dev-cluster",
        help="local Kubernetes control plane + KubeRay + simulated GPU/EFA nodes (no Docker, no cloud)",
        description="A real kube-apiserver/etcd/scheduler/controller-manager, the KubeRay operator and "
        "kwok-simulated EKS nodes, built from Go modules and run as local processes.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help=f"state, certificates, logs (default $FINETUNE_DEVCLUSTER_DIR or {default_workdir()})",
    )
    sub = p.add_subparsers(dest="dev_cluster_command", metavar="{up,down,status,kubeconfig,build,images,demo}")
    sub.required = True
    up = sub.add_parser(
        "up", parents=[common], help="build what is missing, start everything, wait until nodes are Ready"
    )
    up.add_argument("--nodes", type=int, default=2, help="simulated GPU nodes (default 2)")
    up.add_argument("--instance-type", default="g6.12xlarge", help="GPU node instance type")
    up.add_argument("--cpu-instance-type", default="m5.2xlarge", help="instance type of the Ray head node")
    up.add_argument(
        "--crds",
        type=Path,
        action="append",
        default=None,
        help="directory of CRD YAMLs to install (repeatable; default: the checkout's crds/)",
    )
    up.add_argument(
        "--timeout", type=float, default=None, help="seconds to wait for readiness (default 180; 420 with --real-node)"
    )
    up.add_argument(
        "--real-node",
        action="store_true",
        help="also a real kubelet node (containerd, runc, CNI bridge, kube-proxy, CoreDNS, simulated GPU/EFA "
        "device plugin) that runs pods for real; builds its parts on first use",
    )
    sub.add_parser("down", parents=[common], help="stop every component (idempotent); logs are kept")
    st = sub.add_parser("status", parents=[common], help="components, apiserver health, nodes (exit 1 if not running)")
    st.add_argument("--json", action="store_true")
    sub.add_parser("kubeconfig", parents=[common], help="print the admin kubeconfig path")
    b = sub.add_parser("build", parents=[common], help="only build the binaries (cached under $FINETUNE_CACHE_DIR)")
    b.add_argument(
        "components", nargs="*", help="subset of kubernetes, etcd, kuberay, kwok, ... (default: the control plane)"
    )
    b.add_argument("--force", action="store_true", help="rebuild even if cached")
    b.add_argument("--real-node", action="store_true", help="also the real node's parts (kubelet, containerd, ...)")
    im = sub.add_parser("images", help="build the real node's images (Ray on the DLC stack, operator by buildah); "
                        "see `python -m finetune_devcluster.images --help`")
    im.add_argument("images_args", nargs=argparse.REMAINDER, help="[ray] [operator] [base] [--stack dlc|project] [--json]")
    demo = sub.add_parser(
        "demo", parents=[common],
        help="up --real-node, import the Ray and operator images, install the operator from deploy/, "
        "kubectl apply -f examples/local-cluster.yaml and watch it until it ends (make demo-cluster)",
    )
    demo.add_argument("--keep", action="store_true", help="leave the cluster running afterwards")
    demo.add_argument("--helm", action="store_true",
                      help="install the operator with the Helm chart (deploy/helm, helm built from its module) "
                      "instead of kustomize")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    cmd = args.dev_cluster_command
    if cmd == "build":
        flags = [*(["--force"] if args.force else []), *(["--real-node"] if args.real_node else [])]
        return build.main([*args.components, *flags])
    if cmd == "images":
        from . import images

        return images.main(list(args.images_args))
    if cmd == "demo":
        from . import demo as demo_mod

        return demo_mod.demo(args.workdir, keep=args.keep, helm=args.helm)
    log = lambda msg: print(msg, file=sys.stderr)  # noqa: E731  (stdout stays clean for `kubeconfig`)
    if cmd == "up":
        cluster = DevCluster(
            args.workdir,
            nodes=args.nodes,
            instance_type=args.instance_type,
            cpu_instance_type=args.cpu_instance_type,
            crd_dirs=args.crds,
            log=log,
            real_node=args.real_node,
        )
        try:
            cluster.up(timeout=args.timeout or (420 if args.real_node else 180))
        except (DevClusterError, build.BuildError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(cluster.kubeconfig)
        return 0
    cluster = DevCluster(args.workdir, log=log)
    if cmd == "down":
        cluster.down()
        return 0
    if cmd == "kubeconfig":
        print(cluster.kubeconfig)
        return 0 if cluster.kubeconfig.is_file() else 1
    status = cluster.status()
    if args.json:
        print(json.dumps(status, indent=2))
    else:
        print(f"workdir:    {status['workdir']}\nphase:      {status['phase']}\nkubeconfig: {status['kubeconfig']}")
        for name, c in status["components"].items():
            print(f"  {name:<24} pid {c['pid']:<8} {'running' if c['alive'] else 'DEAD'}")
        if "apiserver" in status:
            print(f"apiserver:  {status['apiserver']} ({status['server']})")
        for n in status.get("nodes", []):
            print(f"  node {n['name']:<20} {n['instanceType']:<14} {'Ready' if n['ready'] else 'NotReady'}")
    ok = bool(status["components"]) and all(c["alive"] for c in status["components"].values())
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry point: ``python -m finetune_devcluster.cli up`` (same as
    ``finetune dev-cluster up``)."""
    parser = argparse.ArgumentParser(prog="finetune")
    register(parser.add_subparsers(dest="command", required=True))
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] != ["dev-cluster"]:
        argv.insert(0, "dev-cluster")
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
