"""Composition root: settings → catalog → verifier → ingestor → watcher.

``Daemon(settings).start()`` refuses to run on a catalog whose schema is not exactly this ckptd's
(``ckptd db upgrade`` first). ``stop()`` stops events, then drains verification.
"""

from __future__ import annotations

import logging
import os

from sqlalchemy.orm import sessionmaker

from ckptd.catalog.db import make_engine, require_current_schema
from ckptd.errors import CkptdError
from ckptd.service.ingest import Ingestor
from ckptd.service.verifier import Verifier
from ckptd.settings import Settings
from ckptd.watcher import Watcher

log = logging.getLogger("ckptd.daemon")


class Daemon:
    def __init__(self, settings: Settings) -> None:
        if not os.path.isdir(settings.root):
            raise CkptdError("checkpoint root is not a directory", path=str(settings.root), hint="create it or pass --root")
        self.settings = settings
        self.engine = make_engine(settings.db)
        require_current_schema(self.engine)
        self.sessions = sessionmaker(self.engine, expire_on_commit=False)
        self.verifier = Verifier(settings, self.sessions)
        self.ingestor = Ingestor(settings, self.sessions, self.verifier.submit, self.verifier.submit_step)
        self.watcher = Watcher(
            self.ingestor,
            debounce=settings.debounce,
            rescan_interval=settings.rescan_interval,
            settle_seconds=settings.settle_seconds,
        )

    def start(self) -> None:
        log.info("watching %s (catalog %s)", self.settings.root, self.engine.url.render_as_string(hide_password=True))
        self.watcher.start()

    def stop(self) -> None:
        self.watcher.stop()
        self.verifier.drain(timeout=60)
        self.verifier.close()
        self.engine.dispose()
