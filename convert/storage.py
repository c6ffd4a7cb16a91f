"""Where a conversion's output lives: a local folder, or s3://bucket/prefix on any S3-compatible store.

Both stores offer the same few operations on paths relative to the output root. Sub-datasets are
always written by MDSWriter into a local folder first: in place for a local output, in the work dir
for S3, then uploaded by `publish` (index.json last) so an interrupted upload never looks finished.
S3 goes through boto3 with the endpoint in S3_ENDPOINT_URL (as mosaicml-streaming reads it) and the
usual AWS credential chain. Every S3 failure becomes a ConvertError naming the operation, the object
and the endpoint, in one line.
"""

import fcntl
import json
import logging
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from common.atomic import atomic_write_bytes
from convert.common import ConvertError

log = logging.getLogger(__name__)

LOCK = ".sd-convert.lock"

# Descriptors of the output locks this process holds. flock belongs to the open file description,
# which fork shares: a child holding a copy keeps the lock for as long as it lives, even after the
# parent is gone. Children therefore close their copies first thing after the fork; closing a copy
# never unlocks the parent's (an explicit LOCK_UN would, so children must not unlock).
_HELD_LOCKS: set[int] = set()


def _drop_inherited_locks() -> None:
    for fd in _HELD_LOCKS:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD_LOCKS.clear()


os.register_at_fork(after_in_child=_drop_inherited_locks)


def open_store(out: str) -> "LocalStore | S3Store":
    if out.startswith("s3://"):
        return S3Store(out)
    if "://" in out:
        raise ConvertError(f"--out {out}: only local paths and s3:// URIs are supported")
    return LocalStore(out)


class LocalStore:
    def __init__(self, root: str):
        self.root = Path(root).expanduser()
        self.url = str(self.root)

    def check(self) -> None:
        """Writable, without creating anything yet: a run that fails early leaves no empty folder."""
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        if not probe.is_dir() or not os.access(probe, os.W_OK | os.X_OK):
            raise ConvertError(f"--out {self.root}: cannot write there ({probe} is not a writable folder)")

    @contextmanager
    def lock(self):
        """One conversion per output folder at a time; the OS drops the lock if the process dies.

        The lock belongs to this process alone: forked children (the pool's workers) close their
        copy of its descriptor at once (`_drop_inherited_locks`), so that a child the parent's death
        does not reach cannot keep the output locked against the rerun."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ConvertError(f"--out {self.root}: cannot write there ({err.strerror or err})") from None
        fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConvertError(f"--out {self.root}: another sd-convert is writing there") from None
        _HELD_LOCKS.add(fd)
        try:
            yield
        finally:
            _HELD_LOCKS.discard(fd)
            os.close(fd)

    def entries(self, rel: str = "") -> list[str]:
        """The names directly under `rel` (files and folders); none when it does not exist."""
        try:
            return sorted(os.listdir(self.root / rel))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, rel: str) -> None:
        """Delete one file; a missing one is fine."""
        (self.root / rel).unlink(missing_ok=True)

    def staging(self, rel: str, work_dir: Path) -> Path:
        return self.root / rel

    def clear(self, rel: str) -> None:
        shutil.rmtree(self.root / rel, ignore_errors=True)

    def publish(self, local: Path, rel: str) -> None:
        """Nothing to do: MDSWriter wrote the sub-dataset in place."""

    def read_json(self, rel: str):
        try:
            return json.loads((self.root / rel).read_text())
        except FileNotFoundError:
            return None

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return (self.root / rel).read_bytes()
        except FileNotFoundError:
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        atomic_write_bytes(self.root / rel, data)  # a reader sees the old file or the new one

    def list_names(self, rel_dir: str, suffix: str) -> list[str]:
        folder = self.root / rel_dir
        if not folder.is_dir():
            return []
        # Dot-names are temporaries of atomic writes (.tmp-PID-NAME), possibly left by a killed run.
        names = (p.name for p in folder.iterdir() if not p.name.startswith("."))
        return sorted(name[: -len(suffix)] for name in names if name.endswith(suffix))


class S3Store:
    def __init__(self, url: str):
        bucket, _, prefix = url[len("s3://") :].partition("/")
        if not bucket:
            raise ConvertError(f"--out {url}: no bucket name")
        self.url, self.bucket, self.prefix = url.rstrip("/"), bucket, prefix.strip("/")
        self.endpoint = os.environ.get("S3_ENDPOINT_URL") or None
        self._client, self._pid = None, None

    def __getstate__(self):  # boto3 clients are neither picklable nor safe to share across a fork
        return {**self.__dict__, "_client": None, "_pid": None}

    @property
    def client(self):
        if self._client is None or self._pid != os.getpid():
            import boto3
            from botocore.config import Config

            config = Config(
                connect_timeout=10, read_timeout=120, retries={"max_attempts": 3, "mode": "standard"}
            )
            # a fresh session, not boto3's default one, which caches the credentials it first found
            self._client = boto3.session.Session().client("s3", endpoint_url=self.endpoint, config=config)
            self._pid = os.getpid()
        return self._client

    def key(self, rel: str) -> str:
        return f"{self.prefix}/{rel}" if self.prefix else rel

    def _fail(self, err: Exception, what: str, rel: str) -> ConvertError:
        from botocore.exceptions import ClientError, NoCredentialsError

        where = f"s3://{self.bucket}/{self.key(rel)}"
        endpoint = self.endpoint or "the AWS default endpoint"
        if isinstance(err, NoCredentialsError):
            return ConvertError(
                f"{what} {where}: no S3 credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
            )
        if isinstance(err, ClientError):
            code = err.response.get("Error", {}).get("Code", "?")
            if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403", "Forbidden"):
                return ConvertError(f"{what} {where}: S3 at {endpoint} refused the credentials ({code})")
            if code in ("NoSuchBucket", "404", "NotFound") and not rel:
                return ConvertError(f"{what} {where}: bucket {self.bucket!r} does not exist at {endpoint}")
            return ConvertError(f"{what} {where} failed at {endpoint}: {code} {err}")
        return ConvertError(f"{what} {where}: cannot reach S3 endpoint {endpoint} ({type(err).__name__})")

    @contextmanager
    def lock(self):
        yield  # S3 has no locks; one writer per prefix is the user's contract

    def check(self) -> None:
        try:
            self.client.head_bucket(Bucket=self.bucket)
            self.client.list_objects_v2(Bucket=self.bucket, Prefix=self.key(""), MaxKeys=1)
        except Exception as err:
            raise self._fail(err, "checking", "") from None

    def staging(self, rel: str, work_dir: Path) -> Path:
        return work_dir / "upload" / rel

    def _keys(self, rel: str) -> list[str]:
        pages = self.client.get_paginator("list_objects_v2").paginate(
            Bucket=self.bucket, Prefix=self.key(rel)
        )
        return [obj["Key"] for page in pages for obj in page.get("Contents", [])]

    def entries(self, rel: str = "") -> list[str]:
        """The names directly under `rel`: objects, and "folders" (common prefixes)."""
        base = self.key(rel.strip("/") + "/" if rel else "")
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=base, Delimiter="/"
            )
            names = set()
            for page in pages:
                names.update(obj["Key"][len(base) :] for obj in page.get("Contents", []))
                names.update(p["Prefix"][len(base) :].rstrip("/") for p in page.get("CommonPrefixes", []))
        except Exception as err:
            raise self._fail(err, "listing", rel) from None
        return sorted(n for n in names if n)

    def remove(self, rel: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key(rel))
        except Exception as err:
            raise self._fail(err, "deleting", rel) from None

    def clear(self, rel: str) -> None:
        try:
            keys = self._keys(rel.rstrip("/") + "/")
            for start in range(0, len(keys), 1000):
                batch = [{"Key": k} for k in keys[start : start + 1000]]
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as err:
            raise self._fail(err, "clearing", rel) from None

    def publish(self, local: Path, rel: str) -> None:
        """Upload a finished sub-dataset, index.json last, then drop the local copy."""
        files = sorted(p for p in local.rglob("*") if p.is_file())
        files.sort(key=lambda p: p.name == "index.json")
        for path in files:
            self.write_file(f"{rel}/{path.relative_to(local).as_posix()}", path)
        shutil.rmtree(local, ignore_errors=True)

    def write_file(self, rel: str, path: Path) -> None:
        with open(path, "rb") as body:
            self._put(rel, body)

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._put(rel, data)

    def _put(self, rel: str, body) -> None:
        extra = {"ACL": os.environ["S3_CANNED_ACL"]} if os.environ.get("S3_CANNED_ACL") else {}
        try:
            self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, **extra)
        except Exception as err:
            raise self._fail(err, "uploading", rel) from None

    def read_json(self, rel: str):
        body = self.read_bytes(rel)
        return None if body is None else json.loads(body)

    def read_bytes(self, rel: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key(rel))["Body"].read()
        except Exception as err:
            if getattr(err, "response", {}).get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                return None
            raise self._fail(err, "reading", rel) from None

    def list_names(self, rel_dir: str, suffix: str) -> list[str]:
        try:
            keys = self._keys(rel_dir.rstrip("/") + "/")
        except Exception as err:
            raise self._fail(err, "listing", rel_dir) from None
        names = (k.rsplit("/", 1)[-1] for k in keys)
        return sorted(n[: -len(suffix)] for n in names if n.endswith(suffix))
