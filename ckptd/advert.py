"""Where the daemon serving a catalog answers, on this machine: a ``ckptd serve`` advertises its
URL under a name derived from its catalog's URL; ``ckptd ls`` / ``ckptd resume`` with no
``--ckptd-url`` look there and ask that daemon instead of opening the catalog themselves.

Why: opening the catalog costs ~0.5 s of imports (SQLAlchemy, the ORM models, pydantic) before the
first query, while asking the node's daemon costs ~0.05 s -- and that daemon answers from the very
same catalog through the same service functions, so the answer is the same. Like the Docker CLI
and its daemon's socket, the fast path needs no flag on a node where ``ckptd serve`` runs.

The advertisement is ``<dir>/<key>.json`` (``{"url", "pid", "start", "catalog"}``; the catalog
URL's password is never written), in ``$XDG_RUNTIME_DIR/ckptd`` or else ``<tmp>/ckptd-<uid>``, a
directory of this user's alone (0700, owned by us: anything else is not trusted and not used).
``key`` is a hash of the catalog URL (a SQLite file by its real path; another URL without its
password), so a daemon of another catalog is never asked. A daemon killed without cleaning up
leaves a file whose process is gone (its pid and start time no longer match a live process):
ignored. A daemon that is alive but does not answer is the caller's to fall back from.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from urllib.parse import urlsplit, urlunsplit

from ckptd import procs
from ckptd.atomic import atomic_write


def catalog_key(catalog: str) -> str:
    """The name a catalog URL is advertised under (equal for the URLs of one catalog)."""
    return hashlib.sha256(normalized(catalog).encode()).hexdigest()[:32]


def normalized(catalog: str) -> str:
    """``catalog`` as one string per database: a plain SQLite file by its real absolute path,
    another URL without its password (a password is no part of which database it is)."""
    if catalog.startswith("sqlite:///") and "?" not in catalog:
        path = catalog[len("sqlite:///"):]
        if path and path != ":memory:" and not path.startswith("file:"):
            return "sqlite:///" + os.path.realpath(path)
        return catalog
    parts = urlsplit(catalog)
    if parts.password is None:
        return catalog
    host = parts.hostname or ""
    netloc = f"{parts.username}@{host}" if parts.username else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def directory(create: bool = False) -> str | None:
    """This user's advertisement directory, None when it is missing or not trustworthy (another
    owner, or others may write it: a file there could send our questions elsewhere)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "ckptd") if base else os.path.join(tempfile.gettempdir(), f"ckptd-{os.geteuid()}")
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return None
    try:
        st = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        return None
    return path


def advertise(catalog: str, url: str) -> str | None:
    """Record that this process answers for ``catalog`` at ``url``; returns the file to
    :func:`withdraw` at exit, or None when there is no trustworthy place to write it."""
    where = directory(create=True)
    if where is None:
        return None
    me = procs.stat(os.getpid())
    doc = {"url": url, "pid": os.getpid(), "start": me.start if me else None, "catalog": normalized(catalog)}
    path = os.path.join(where, catalog_key(catalog) + ".json")
    with atomic_write(path, overwrite=True, mode=0o600) as fh:
        fh.write(json.dumps(doc).encode())
    return path


def withdraw(path: str | None) -> None:
    """Remove this process's advertisement (not one a newer daemon of the catalog wrote since)."""
    if path is None:
        return
    try:
        with open(path, "rb") as fh:
            doc = json.loads(fh.read())
        if doc.get("pid") == os.getpid():
            os.unlink(path)
    except (OSError, ValueError, AttributeError):
        pass


def find(catalog: str) -> str | None:
    """The URL of the live daemon advertising ``catalog`` on this machine, or None."""
    where = directory()
    if where is None:
        return None
    try:
        with open(os.path.join(where, catalog_key(catalog) + ".json"), "rb") as fh:
            doc = json.loads(fh.read())
        url, pid, start = doc["url"], int(doc["pid"]), doc.get("start")
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(url, str) or doc.get("catalog") != normalized(catalog):
        return None
    return url if procs.alive(pid, int(start) if isinstance(start, int) else None) else None
