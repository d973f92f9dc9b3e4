"""Files on the job's storage: local/PVC paths and `s3://` URIs through one pyarrow filesystem API.

`pvc://` URIs are first mapped to their mount path with `finetune_operator.api.storage.resolve_in_pod`.
A source means what it names: `s3://bucket/x/file.jsonl` (or `/data/file.jsonl`) is one file,
`s3://bucket/x/` (or a directory) is every file under it; `get_file_info(path).type` tells them apart.

S3 credentials and endpoint come from the standard AWS chain as the AWS SDK inside pyarrow reads it:
`AWS_ACCESS_KEY_ID`/`AWS_SECRET_ACCESS_KEY` (+ `AWS_SESSION_TOKEN`), IRSA web identity
(`AWS_ROLE_ARN` + `AWS_WEB_IDENTITY_TOKEN_FILE`), the EKS Pod Identity agent
(`AWS_CONTAINER_CREDENTIALS_FULL_URI`), a profile; region from `AWS_REGION`; an S3-compatible endpoint from
`AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`). pyarrow applies the endpoint variables to filesystems made
by `FileSystem.from_uri` (as here and in Ray Train), not to a bare `S3FileSystem()`.

A source that cannot be read (no such object or prefix, no such bucket, no or wrong credentials, access
denied, wrong region) raises `StorageError`: one line naming the field, the URI and the cause.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from finetune_operator.api.storage import is_remote, resolve_in_pod

from .errors import DeterministicError


class StorageError(DeterministicError, RuntimeError):
    """A storage URI that cannot be used, for a reason retrying does not change (missing object, prefix or
    bucket, credentials, access, region). The message is one line: `<field>: <uri>: <cause>`.

    Deterministic: the run fails at once instead of restarting the workers (`failfast`).
    """


# Markers in the AWS SDK's error text (pyarrow raises OSError with it) -> what the user is told.
_CAUSES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("NO_SUCH_BUCKET", "NoSuchBucket"), "the bucket does not exist"),
    (("ACCESS_DENIED", "AccessDenied", "HTTP response code: 403"),
     "access denied (the credentials in use may not read it: check the role's S3 policy)"),
    (("INVALID_ACCESS_KEY_ID", "InvalidAccessKeyId", "SIGNATURE_DOES_NOT_MATCH", "SignatureDoesNotMatch",
      "No credentials", "MISSING_AUTHENTICATION_TOKEN", "Unable to find credentials", "EXPIRED_TOKEN"),
     "no valid AWS credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, or give the pods a service "
     "account with IRSA or EKS Pod Identity)"),
    (("PermanentRedirect", "AuthorizationHeaderMalformed", "HTTP response code: 301", "wrong region"),
     "the bucket is in another region (set AWS_REGION to the bucket's region)"),
)


def explain(error: BaseException) -> str:
    """The cause of a pyarrow/AWS error in a few words, one line."""
    text = str(error)
    for markers, cause in _CAUSES:
        if any(m in text for m in markers):
            return cause
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return first[:300]


def filesystem(uri: str) -> tuple[Any, str]:
    """(pyarrow FileSystem, path on it) for a spec URI or a local path."""
    import pyarrow.fs as pafs

    uri = resolve_in_pod(uri)
    if is_remote(uri):
        fs, path = pafs.FileSystem.from_uri(uri)
        return fs, path
    return pafs.LocalFileSystem(), os.path.abspath(uri)


def files_of(uri: str, field: str) -> tuple[Any, str, list[Any]]:
    """(filesystem, path, the FileInfos of its files): the object itself, or every file under the prefix.

    Raises StorageError naming `field`, the URI and the cause when there is nothing to read.
    """
    import pyarrow.fs as pafs

    try:
        fs, path = filesystem(uri)
        info = fs.get_file_info(path)
        if info.type == pafs.FileType.File:
            return fs, path, [info]
        if info.type == pafs.FileType.Directory:
            infos = fs.get_file_info(pafs.FileSelector(path, recursive=True))
            files = sorted((i for i in infos if i.type == pafs.FileType.File), key=lambda i: str(i.path))
            if not files:
                raise StorageError(f"{field}: {uri}: no files under this prefix")
            return fs, path, files
        bucket = path.split("/", 1)[0]
        if is_remote(resolve_in_pod(uri)) and fs.get_file_info(bucket).type == pafs.FileType.NotFound:
            raise StorageError(f"{field}: {uri}: {explain(OSError('NoSuchBucket'))} ({bucket!r})")
        raise StorageError(f"{field}: {uri}: no such object or prefix")
    except StorageError:
        raise
    except (OSError, ValueError) as e:  # pyarrow: credentials, access, region, endpoint, malformed URI
        raise StorageError(f"{field}: {uri}: {explain(e)}") from None


def check_source(uri: str, field: str) -> None:
    """Fail early (before Ray starts workers) when an s3:// source cannot be read; local paths are left
    to the callers' own checks."""
    if is_remote(resolve_in_pod(uri)):
        files_of(uri, field)


def local_absolute(uri: str) -> str:
    """A Ray `storage_path`: absolute local path, or the URI itself for S3."""
    uri = resolve_in_pod(uri)
    return uri if is_remote(uri) else os.path.abspath(uri)


def download(uri: str, cache_root: str | Path, field: str = "storage") -> Path:
    """Copy an `s3://bucket/key` object, or everything under an `s3://bucket/prefix`, to
    `cache_root/bucket/key` (once) and return that file or directory.

    The copy lands in a temporary sibling that is renamed into place, so concurrent ranks on one node
    never see a half-written file or directory; a finished copy is reused.
    """
    key = resolve_in_pod(uri).removeprefix("s3://").strip("/")  # no client yet: a cached copy needs none
    target = Path(cache_root) / key
    if target.is_file() or (target / ".complete").exists():
        return target
    fs, path, files = files_of(uri, field)
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    single = len(files) == 1 and files[0].path.rstrip("/") == path.rstrip("/")
    try:
        for info in files:
            dest = tmp if single else tmp / info.path[len(path.rstrip("/")) + 1 :]
            dest.parent.mkdir(parents=True, exist_ok=True)
            with fs.open_input_stream(info.path) as src, open(dest, "wb") as out:
                shutil.copyfileobj(src, out, length=16 << 20)
    except OSError as e:
        _remove(tmp)
        raise StorageError(f"{field}: {uri}: {explain(e)}") from None
    if not single:
        (tmp / ".complete").write_text(uri)
    try:
        tmp.rename(target)
    except OSError:  # another rank finished first
        _remove(tmp)
    return target


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def upload_dir(local_dir: str | Path, uri: str) -> None:
    """Copy a local directory tree to `uri` (local path or s3://)."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    fs.create_dir(path, recursive=True)
    pafs.copy_files(str(Path(local_dir).absolute()), path, source_filesystem=pafs.LocalFileSystem(),
                    destination_filesystem=fs)


def replace_dir(uri: str, write: Callable[[Path], object]) -> None:
    """Put the directory tree `write(dir)` produces at `uri` (local path or s3://), replacing what was there
    only once the new tree is complete.

    Local: written to a temporary sibling, then the old tree is renamed aside, the new one renamed into
    place and the old one removed (a failed write leaves the previous tree as it was). S3 has no rename:
    the tree is written locally, uploaded over the previous one, and only then are the previous tree's
    objects the new one does not have deleted (so no stale file of an older export survives).
    """
    uri = resolve_in_pod(uri)
    if is_remote(uri):
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            upload_dir(tmp, uri)
            remove_others(uri, {p.relative_to(tmp).as_posix() for p in Path(tmp).rglob("*") if p.is_file()})
        return
    final = Path(uri)
    final.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:8]
    new, old = final.parent / f".{final.name}.new-{token}", final.parent / f".{final.name}.old-{token}"
    try:
        write(new)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise
    if final.exists():
        final.rename(old)
    new.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def remove_others(uri: str, keep: set[str]) -> list[str]:
    """Delete the files under `uri` whose path relative to it is not in `keep`; returns those paths."""
    import pyarrow.fs as pafs

    fs, path = filesystem(uri)
    base = path.rstrip("/")
    removed = []
    for info in fs.get_file_info(pafs.FileSelector(base, recursive=True, allow_not_found=True)):
        rel = info.path[len(base) + 1 :]
        if info.type == pafs.FileType.File and rel not in keep:
            fs.delete_file(info.path)
            removed.append(rel)
    return removed
