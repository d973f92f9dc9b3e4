"""Files on the job's storage: local/PVC paths and `s3://` URIs through one pyarrow filesystem API.

`pvc://` URIs are first mapped to their mount path with `finetune_operator.api.storage.resolve_in_pod`.
S3 credentials come from the usual AWS chain (IRSA web identity in EKS pods, env vars, profile).
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from finetune_operator.api.storage import is_remote, resolve_in_pod


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path on it) for a spec URI or a local path."""
    import pyarrow.fs as pafs

    uri = resolve_in_pod(uri)
    if is_remote(uri):
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def local_absolute(uri: str) -> str:
    """A Ray `storage_path`: absolute local path, or the URI itself for S3."""
    uri = resolve_in_pod(uri)
    return uri if is_remote(uri) else os.path.abspath(uri)


def download_prefix(uri: str, cache_root: str | Path) -> Path:
    """Copy everything under an `s3://bucket/prefix` to `cache_root/bucket/prefix` (once) and return it.

    The copy lands in a temporary sibling that is renamed into place, so concurrent ranks on one node
    never see a half-written directory; a finished copy is reused.
    """
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    target = Path(cache_root) / path.strip("/")
    if (target / ".complete").exists():
        return target
    infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
    files = [i for i in infos if i.type == pafs.FileType.File]
    if not files:
        raise FileNotFoundError(f"{uri}: no files under this prefix")
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True, exist_ok=True)
    for info in files:
        rel = info.path[len(path.rstrip("/")) + 1 :]
        dest = tmp / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(info.path) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, length=16 << 20)
    (tmp / ".complete").write_text(uri)
    try:
        tmp.rename(target)
    except OSError:  # another rank finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Copy a local directory tree to `uri` (local path or s3://)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(Path(local_dir).absolute()), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)
