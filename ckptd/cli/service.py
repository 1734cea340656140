"""``ckptd db upgrade`` and ``ckptd watch``: thin edges over the catalog and the daemon."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported by the handlers that read settings: the parser stays light
    from ckptd.settings import Settings


def register(sub: Any) -> None:
    db = sub.add_parser("db", help="catalog schema management")
    db_sub = db.add_subparsers(dest="db_command", metavar="COMMAND")
    up = db_sub.add_parser("upgrade", help="create or migrate the catalog schema to this ckptd's version")
    up.add_argument("--db", metavar="URL", help="catalog URL (default: $CKPTD_DB or embedded SQLite)")
    up.set_defaults(handler=cmd_db_upgrade)

    w = sub.add_parser("watch", help="run the daemon (watcher + verifier) in the foreground")
    add_daemon_flags(w)
    w.set_defaults(handler=cmd_watch)


def add_daemon_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--root", metavar="DIR", help="checkpoint root (<root>/<run>/rank_<r>/...)")
    p.add_argument("--db", metavar="URL", help="catalog URL (default: embedded SQLite)")
    p.add_argument("--key-file", metavar="F", help="raw key bytes for encrypted shards")
    p.add_argument("--world-size", type=int, metavar="N", help="expected ranks when no strategy file says")
    p.add_argument("--require-encryption", action="store_true", default=None, help="plaintext shards are violations")
    p.add_argument("--require-crc", action="store_true", default=None, help=".ckpt shards must carry a CRC")
    p.add_argument("--verify-workers", type=int, metavar="N")
    p.add_argument("--memory-root", metavar="DIR", help="memory tier: where jobs' snapshots live (default /dev/shm/ckptd)")
    p.add_argument("--persist-every", type=int, metavar="N", help="memory tier: persist every N-th step as a file")
    p.add_argument("--object-store", metavar="s3://BUCKET/PREFIX",
                   help="object tier: copy verified steps there (credentials from the AWS_* environment)")
    p.add_argument("-v", "--verbose", action="store_true")


def settings_from(args: argparse.Namespace, **extra: object) -> Settings:
    """Flags override environment / config file; unset flags leave them alone."""
    mapping = {
        "root": "root", "db": "db", "key_file": "key_file", "world_size": "world_size",
        "require_encryption": "require_encryption", "require_crc": "require_crc", "verify_workers": "verify_workers",
        "memory_root": "memory_root", "persist_every": "persist_every", "object_store": "object_store",
    }
    from ckptd.settings import Settings

    overrides = {field: getattr(args, flag) for flag, field in mapping.items() if getattr(args, flag, None) is not None}
    return Settings(**overrides, **extra)


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from ckptd.catalog.db import make_engine, upgrade
    from ckptd.settings import Settings

    settings = Settings(**({"db": args.db} if args.db else {}))
    engine = make_engine(settings.db)
    before, after = upgrade(engine)
    where = engine.url.render_as_string(hide_password=True)
    print(f"catalog {where}: schema {before or 'empty'} -> {after}" if before != after else f"catalog {where}: schema {after} is current")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from ckptd.daemon import Daemon

    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    daemon = Daemon(settings_from(args))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    daemon.start()
    stop.wait()
    daemon.stop()
    return 0
