"""The object tier's backend: S3-compatible storage (AWS S3, Huawei OBS, Ceph RGW, MinIO, SeaweedFS).

One :class:`ObjectStore` per ``s3://BUCKET/PREFIX``. The client is ``obstore`` (Rust's object_store:
multipart uploads with bounded concurrency and ranged GETs in native threads; it beat boto3's
transfer manager on throughput and memory, bench/RESULTS.md), imported when a store is first used
so ``ckptd --help`` never pays for it. Where to connect and who to be follow the S3 conventions
users already have: ``AWS_ENDPOINT_URL`` (``AWS_ENDPOINT_URL_S3``), ``AWS_REGION`` /
``AWS_DEFAULT_REGION``, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN``,
else the shared credentials file (``AWS_SHARED_CREDENTIALS_FILE``, default ``~/.aws/credentials``,
profile ``AWS_PROFILE``). Secrets are held by the client only: never in an error, a log or ``repr``.

An upload is proven by reading the object back and hashing it (xxh3-128, the digest the catalog
keeps of every file): equal to the verified file's digest, the object is that file. A download
hashes the bytes as they arrive into the caller's temp file, which is renamed in only when they
are the manifest's (the caller writes through ``ckptd.storage.PosixStorage``: confined, atomic).
Memory is bounded by ``part_size × concurrency`` whatever the object's size.
"""

from __future__ import annotations

import concurrent.futures
import configparser
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, BinaryIO

import xxhash

from ckptd.errors import CkptdError

PART_SIZE = 8 << 20
CONCURRENCY = 4

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class ObjectStoreError(CkptdError):
    """The object store refused or failed; ``kind`` says which: ``credentials`` (wrong or missing
    keys), ``bucket`` (no such bucket), ``unreachable`` (no answer: retried with back-off),
    ``not_found`` (no such object), ``config`` (a bad URL), ``other``."""

    code = "object_store"
    default_hint = "check object_store, AWS_ENDPOINT_URL and the credentials (AWS_ACCESS_KEY_ID or ~/.aws/credentials)"

    def __init__(self, message: str, kind: str = "other", **kw: Any) -> None:
        super().__init__(message, **kw)
        self.kind = kind


@dataclass(frozen=True)
class StoreURL:
    bucket: str
    prefix: str  # no leading or trailing slash; may be empty

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"


def parse_url(url: str) -> StoreURL:
    """``s3://BUCKET[/PREFIX]`` checked: a bucket name S3 accepts and a prefix of plain components."""
    if not url.startswith("s3://"):
        raise ObjectStoreError(f"object store {url!r} is not an s3:// URL", kind="config",
                               hint="object_store = \"s3://BUCKET/PREFIX\"")
    bucket, _, prefix = url[5:].partition("/")
    prefix = prefix.strip("/")
    if not _BUCKET.match(bucket):
        raise ObjectStoreError(f"object store {url!r}: {bucket!r} is not a valid bucket name", kind="config")
    if prefix and not safe_relative(prefix):
        raise ObjectStoreError(f"object store {url!r}: the prefix must be plain path components", kind="config")
    return StoreURL(bucket, prefix)


def safe_relative(path: str) -> bool:
    """A relative key path of plain components: no ``..``, ``.``, empty component, leading slash,
    backslash or control character (what a manifest may name: nothing outside its run)."""
    if not path or path.startswith("/") or "\\" in path or any(ord(c) < 0x20 or c == "\x7f" for c in path):
        return False
    return all(part not in ("", ".", "..") for part in path.split("/"))


def _shared_credentials() -> tuple[str, str, str | None] | None:
    """(key id, secret, token) of ``AWS_PROFILE`` in the shared credentials file, if there is one."""
    path = os.environ.get("AWS_SHARED_CREDENTIALS_FILE") or os.path.expanduser("~/.aws/credentials")
    parser = configparser.RawConfigParser()
    try:
        if not parser.read(path):
            return None
    except configparser.Error:
        raise ObjectStoreError("the shared credentials file does not parse", kind="credentials", path=path) from None
    profile = os.environ.get("AWS_PROFILE", "default")
    if not parser.has_section(profile) or not parser.has_option(profile, "aws_access_key_id"):
        return None
    sect = parser[profile]
    return sect.get("aws_access_key_id"), sect.get("aws_secret_access_key", ""), sect.get("aws_session_token")


def classify(exc: BaseException) -> str:
    """Which failure an obstore error is (its message carries the server's S3 error code)."""
    text = str(exc)
    name = type(exc).__name__
    if any(c in text for c in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken",
                               "InvalidToken")) or name in ("PermissionDeniedError", "UnauthenticatedError"):
        return "credentials"
    if "NoSuchBucket" in text:
        return "bucket"
    if name == "NotFoundError" or isinstance(exc, FileNotFoundError) or "NoSuchKey" in text:
        return "not_found"
    if any(c in text for c in ("Connection refused", "error sending request", "connection", "timed out",
                               "Timeout", "dns error", "tcp connect")):
        return "unreachable"
    return "other"


_MESSAGES = {
    "credentials": "the object store refused ckptd's credentials",
    "bucket": "the object store has no bucket {bucket!r}",
    "unreachable": "the object store at {endpoint} does not answer",
    "not_found": "no object {key!r}",
}


class ObjectStore:
    """The objects under one ``s3://BUCKET/PREFIX``; keys below are relative to the prefix."""

    def __init__(self, url: str, *, part_size: int = PART_SIZE, concurrency: int = CONCURRENCY) -> None:
        self.url = parse_url(url)
        self.part_size = part_size
        self.concurrency = concurrency
        self.endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS S3"
        self._client: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(concurrency, thread_name_prefix="ckptd-s3")

    def __repr__(self) -> str:
        return f"ObjectStore({str(self.url)!r}, endpoint={self.endpoint!r})"

    def uri(self, key: str) -> str:
        """A copy row's location: ``s3://bucket/prefix/key``."""
        return f"s3://{self.url.bucket}/{self.full_key(key)}"

    def full_key(self, key: str) -> str:
        return f"{self.url.prefix}/{key}" if self.url.prefix else key

    def key_of(self, uri: str) -> str:
        """The relative key of one of this store's URIs (:meth:`uri`'s inverse)."""
        head = f"s3://{self.url.bucket}/" + (f"{self.url.prefix}/" if self.url.prefix else "")
        if not uri.startswith(head):
            raise ObjectStoreError(f"{uri!r} is not below {self.url}", kind="config")
        return uri[len(head):]

    @property
    def client(self) -> Any:
        if self._client is None:
            from obstore.store import S3Store

            config: dict[str, Any] = {}
            if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
                config["endpoint"] = self.endpoint
            config["region"] = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
            if not os.environ.get("AWS_ACCESS_KEY_ID"):
                shared = _shared_credentials()
                if shared is not None:
                    config["access_key_id"], config["secret_access_key"] = shared[0], shared[1]
                    if shared[2]:
                        config["token"] = shared[2]
            self._client = S3Store(
                self.url.bucket, prefix=self.url.prefix or None, config=config,
                client_options={"allow_http": self.endpoint.startswith("http://"), "connect_timeout": timedelta(seconds=5),
                                "timeout": timedelta(seconds=120)},
                # the tier's own loop retries with back-off: a dead server must not hold a thread for minutes
                retry_config={"max_retries": 2, "retry_timeout": timedelta(seconds=20),
                              "backoff": {"init_backoff": timedelta(milliseconds=200),
                                          "max_backoff": timedelta(seconds=2), "base": 2}})
        return self._client

    def _error(self, exc: BaseException, key: str) -> ObjectStoreError:
        kind = classify(exc)
        msg = _MESSAGES.get(kind, "the object store failed on {key!r}: {detail}").format(
            bucket=self.url.bucket, endpoint=self.endpoint, key=self.full_key(key),
            detail=str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
        return ObjectStoreError(msg, kind=kind)

    def _call(self, key: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except ObjectStoreError:
            raise
        except Exception as exc:  # obstore's errors (it raises FileNotFoundError for a 404) as one kind
            raise self._error(exc, key) from None

    # --- small objects -------------------------------------------------------------------------

    def put_bytes(self, key: str, data: bytes) -> None:
        import obstore

        self._call(key, lambda: obstore.put(self.client, key, data, use_multipart=False))

    def get_bytes(self, key: str, limit: int) -> bytes:
        """An object whole, refusing one over ``limit`` bytes (a manifest: never trust its size)."""
        size = self.head(key)
        if size is None:
            raise ObjectStoreError(_MESSAGES["not_found"].format(key=self.full_key(key)), kind="not_found")
        if size > limit:
            raise ObjectStoreError(f"object {self.full_key(key)!r} has {size} bytes, more than {limit}", kind="other")
        import obstore

        return bytes(self._call(key, lambda: obstore.get(self.client, key).bytes()))

    def head(self, key: str) -> int | None:
        """An object's size, or None when there is none."""
        import obstore

        try:
            return int(self._call(key, lambda: obstore.head(self.client, key))["size"])
        except ObjectStoreError as err:
            if err.kind == "not_found":
                return None
            raise

    def delete(self, key: str) -> None:
        import obstore

        self._call(key, lambda: obstore.delete(self.client, key))

    def list(self, key_prefix: str) -> list[tuple[str, int]]:
        """(relative key, size) of every object below ``key_prefix``."""
        import obstore

        def run() -> list[tuple[str, int]]:
            out = []
            for batch in obstore.list(self.client, key_prefix):
                out.extend((m["path"], int(m["size"])) for m in batch)
            return out

        return self._call(key_prefix, run)

    def check_access(self) -> None:
        """One cheap request that fails with the right kind when the bucket or the keys are wrong."""
        import obstore

        self._call("", lambda: obstore.list_with_delimiter(self.client, None))

    # --- files ---------------------------------------------------------------------------------

    def put_file(self, key: str, path: str) -> int:
        """Upload the file at ``path`` (an already confined ``/proc/self/fd/N`` name or a plain path)
        as ``key``: a multipart upload of ``part_size`` parts, ``concurrency`` in flight, read by
        obstore's native threads (faster than feeding it from Python: bench/RESULTS.md). Returns
        the size sent; what arrived is proven by reading it back (:meth:`digest`)."""
        import obstore
        from pathlib import Path

        size = os.stat(path).st_size
        if size <= self.part_size:
            with open(path, "rb") as f:
                data = f.read()
            self._call(key, lambda: obstore.put(self.client, key, data, use_multipart=False))
            return len(data)
        self._call(key, lambda: obstore.put(self.client, key, Path(path), chunk_size=self.part_size,
                                            max_concurrency=self.concurrency))
        return size

    def _ranges(self, key: str, size: int) -> Iterator[bytes]:
        """The object's bytes in order, as parallel ranged GETs (at most ``concurrency`` parts held)."""
        import obstore

        starts = list(range(0, size, self.part_size))
        pending: dict[int, concurrent.futures.Future] = {}
        nxt = 0
        for i, start in enumerate(starts):
            while nxt < len(starts) and len(pending) < self.concurrency:
                s0 = starts[nxt]
                pending[nxt] = self._pool.submit(
                    self._call, key, lambda s0=s0: obstore.get_range(self.client, key, start=s0,
                                                                      length=min(self.part_size, size - s0)))
                nxt += 1
            data = pending.pop(i).result()
            if len(data) != min(self.part_size, size - start):
                raise ObjectStoreError(f"object {self.full_key(key)!r} is shorter than {size} bytes", kind="other")
            yield data

    def digest(self, key: str, size: int) -> str:
        """xxh3-128 of the object as stored (a read-back: what proves an upload, and what a scrub
        re-checks). Raises when it is shorter than ``size``; a longer one hashes differently."""
        actual = self.head(key)
        if actual is None:
            raise ObjectStoreError(_MESSAGES["not_found"].format(key=self.full_key(key)), kind="not_found")
        h = xxhash.xxh3_128()
        for data in self._ranges(key, actual):
            h.update(memoryview(data))
        return h.hexdigest() if actual == size else f"size {actual}, expected {size}"

    def download(self, key: str, out: BinaryIO, size: int, digest: str,
                 progress: Callable[[int], None] | None = None) -> None:
        """Write ``key``'s bytes to ``out`` (the caller's temp file: ``PosixStorage.create``, which
        renames it in only when this returns) and check they are ``size`` bytes hashing to
        ``digest``; raises otherwise, so nothing wrong is ever renamed in."""
        actual = self.head(key)
        if actual != size:
            raise ObjectStoreError(f"object {self.full_key(key)!r} has {actual} bytes, the manifest says {size}",
                                   kind="not_found" if actual is None else "other")
        h = xxhash.xxh3_128()
        for data in self._ranges(key, size):
            view = memoryview(data)
            h.update(view)
            out.write(view)
            if progress is not None:
                progress(len(view))
        if h.hexdigest() != digest:
            raise ObjectStoreError(f"object {self.full_key(key)!r} does not match its manifest "
                                   f"(xxh3-128 {h.hexdigest()[:12]}…, expected {digest[:12]}…)", kind="other")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
