"""`finetune`: one command for the CRD, validation, rendering, local runs, the operator, the dev cluster."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from .api.validation import SpecError, check, load_documents, parse_job

# Subcommands owned by other packages register themselves; a missing optional part (e.g. the training
# extra not installed) removes its subcommand instead of breaking the others.
_PLUGINS = ("finetune_training.cli", "finetune_operator.devcluster.cli", "finetune_operator.runner",
            "finetune_operator.preflight_cli")


def _read(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    return Path(path).read_text()


def cmd_crd(args: argparse.Namespace) -> int:
    from .api.crd import crd_yaml
    from .api.docs import reference_markdown

    sys.stdout.write(reference_markdown() if args.markdown else crd_yaml())
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    failed = 0
    for path in args.files:
        if path != "-" and not Path(path).is_file():
            print(f"{path}: no such file", file=sys.stderr)
            failed += 1
            continue
        try:
            docs = load_documents(_read(path))
        except SpecError as err:
            for issue in err.issues:
                print(f"{path}: {issue}", file=sys.stderr)
            failed += 1
            continue
        if not docs:
            print(f"{path}: no FinetuneJob document found", file=sys.stderr)
            failed += 1
            continue
        for i, doc in enumerate(docs):
            where = path if len(docs) == 1 else f"{path}[{i}]"
            job, issues = check(doc)
            for issue in issues:
                print(f"{where}: {issue}", file=sys.stderr)
            if job is None:
                failed += 1
            else:
                print(f"{where}: ok ({job.metadata.name})")
    return 1 if failed else 0


def cmd_render(args: argparse.Namespace) -> int:
    from .render.bundle import runtime_files
    from .render.config import RenderConfig
    from .render.rayjob import render_children, to_yaml

    if args.file != "-" and not Path(args.file).is_file():
        print(f"{args.file}: no such file", file=sys.stderr)
        return 1
    try:
        docs = load_documents(_read(args.file))
        if len(docs) != 1:
            print(f"{args.file}: expected exactly one FinetuneJob document, found {len(docs)}", file=sys.stderr)
            return 1
        doc = docs[0]
        if isinstance(doc, dict):
            meta = doc.setdefault("metadata", {})
            if args.namespace:
                meta["namespace"] = args.namespace
            if args.uid:
                meta["uid"] = args.uid
        job = parse_job(doc)
        objs = render_children(job, runtime_files(), RenderConfig(progress_url=args.progress_url))
    except SpecError as err:
        for issue in err.issues:
            print(f"{args.file}: {issue}", file=sys.stderr)
        return 1
    if args.no_runtime:
        objs = [o for o in objs if o["metadata"]["name"] != f"{job.metadata.name}-runtime"]
    sys.stdout.write(to_yaml(objs))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune",
        description="Multi-node LLM fine-tuning on KubeRay with one FinetuneJob resource.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("crd", help="print the FinetuneJob CustomResourceDefinition (generated from the models)")
    p.add_argument("--markdown", action="store_true", help="print the field reference (docs/api.md) instead")
    p.set_defaults(func=cmd_crd)

    p = sub.add_parser("validate", help="check FinetuneJob files; one line per problem, exit 1 if any")
    p.add_argument("files", nargs="+", metavar="FILE", help="FinetuneJob YAML files ('-' for stdin)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("render", help="print the child objects (ConfigMaps + RayJob) as YAML")
    p.add_argument("file", metavar="FILE", help="a FinetuneJob YAML file ('-' for stdin)")
    p.add_argument("--namespace", help="namespace to render into (default: the document's)")
    p.add_argument("--uid", help="FinetuneJob UID, to render ownerReferences as the operator does")
    p.add_argument("--progress-url", help="base URL of the operator's progress endpoint, as the operator renders it")
    p.add_argument("--no-runtime", action="store_true", help="leave out the ConfigMap carrying the training code")
    p.set_defaults(func=cmd_render)

    for name in _PLUGINS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if err.name and name.startswith(err.name):  # that part is not installed / not written yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
