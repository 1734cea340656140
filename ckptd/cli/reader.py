"""Where ``ckptd ls`` and ``ckptd resume`` get their answers: a running daemon, or the catalog itself.

With ``--ckptd-url URL`` (or ``$CKPTD_URL``, the variable the launcher and the training callback
already read; ``--db`` on the command line wins over it) the command asks the daemon's API over
HTTP, with ``$CKPTD_TOKEN`` as the bearer token like the launcher. Otherwise it opens the catalog
(SQLAlchemy, the ORM models, pydantic settings, the schema guard).

Why both: opening the catalog costs ~0.3 s of imports before the first query (SQLAlchemy builds its
classes at import), five times a bare interpreter's start, which a launcher polling ``ckptd resume
--json`` or an operator's shell pays on every call. The daemon's answers are the service's own —
the same functions behind its routes, the resume answer the oracle's body byte for byte — so
asking it is no second source of truth, and this module imports only the standard library until
the catalog is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Iterator
from typing import Any

from ckptd.errors import CkptdError

#: seconds to wait for the daemon (a resume answer on a cold cache reads the catalog)
TIMEOUT = 30.0


class DaemonError(CkptdError):
    code = "daemon"
    default_hint = "check --ckptd-url / $CKPTD_URL and $CKPTD_TOKEN, or give --db to read the catalog directly"


class NoAnswer(CkptdError):
    """Nothing restorable: the oracle's ``detail`` (``code``, ``message``, ``hint``, ``skipped``, ...)."""

    code = "no_restorable_step"

    def __init__(self, detail: dict[str, Any]) -> None:
        super().__init__(str(detail.get("message") or "no restorable step"), hint=detail.get("hint"))
        self.detail = detail


def add_url_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckptd-url", metavar="URL",
                   help="ask the daemon at URL instead of opening the catalog (default $CKPTD_URL unless --db is given; "
                        "token: $CKPTD_TOKEN)")


def daemon_url(args: argparse.Namespace) -> str | None:
    """The daemon to ask, or None to open the catalog: ``--ckptd-url``; else ``$CKPTD_URL`` unless
    ``--db`` names a catalog on the command line (the more specific wish wins)."""
    url = getattr(args, "ckptd_url", None)
    if url:
        if getattr(args, "db", None):
            err = CkptdError("give --db or --ckptd-url, not both",
                             hint="--db reads a catalog directly; --ckptd-url asks the daemon serving one")
            err.code = "usage"
            raise err
        return url
    if getattr(args, "db", None):
        return None
    return os.environ.get("CKPTD_URL") or None


@contextlib.contextmanager
def reader(args: argparse.Namespace, write: bool = False) -> Iterator[DaemonReader | CatalogReader]:
    """The source of a command's answers (``write``: the catalog session commits, e.g. a resume lease)."""
    url = daemon_url(args)
    if url is not None:
        yield DaemonReader(url)
        return
    from ckptd.cli.catalog_cmds import catalog_sessions

    settings, sessions = catalog_sessions(args)
    with (sessions.begin() if write else sessions()) as s:
        yield CatalogReader(settings, s)


class DaemonReader:
    """Answers from ``GET`` routes of the daemon's API (docs/API.md)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def list_runs(self) -> list[dict[str, Any]]:
        return self._get("/v1/runs")

    def list_nodes(self) -> list[dict[str, Any]]:
        return self._get("/v1/nodes")

    def list_steps(self, run: str, state: str | None) -> list[dict[str, Any]]:
        return self._get(f"/v1/runs/{_quote(run)}/steps", {"state": state} if state else None)

    def resume(self, run: str, args: argparse.Namespace) -> dict[str, Any]:
        query = {"max_step": args.max_step, "world_size": args.world_size,
                 "skip_spikes": "true" if args.skip_spikes else None, "lease": "false" if args.no_lease else None,
                 "exclude_unreachable": "true" if args.exclude_unreachable else None}
        return self._get(f"/v1/runs/{_quote(run)}/resume", {k: v for k, v in query.items() if v is not None})

    def allow_hardlinks(self) -> bool:
        from ckptd.settings import Settings  # only --repair-tracker, which writes here, reads this machine's settings

        return Settings().allow_hardlinks

    def _get(self, path: str, query: dict[str, Any] | None = None) -> Any:
        import http.client  # here: the parser of every command imports this module (start-up)
        import urllib.error
        import urllib.parse
        import urllib.request

        target = self.url + path + ("?" + urllib.parse.urlencode(query) if query else "")
        req = urllib.request.Request(target, method="GET", headers={"Accept": "application/json"})
        token = os.environ.get("CKPTD_TOKEN")
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = _detail(err)
            if detail is None:
                raise DaemonError(f"the daemon at {self.url} answered HTTP {err.code} to GET {path}") from None
            if detail.get("code") == "no_restorable_step":
                raise NoAnswer(detail) from None
            # ckptd's own refusal (no such run, a bad state, a token's scope): what the catalog would say
            raise CkptdError(str(detail.get("message") or f"HTTP {err.code}"), hint=detail.get("hint")) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", None) or err
            raise DaemonError(f"the daemon at {self.url} could not be asked: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise DaemonError(f"the daemon at {self.url} answered GET {path} with something that is not JSON") from None


class CatalogReader:
    """Answers from the catalog, through the same service functions the daemon's routes call."""

    def __init__(self, settings: Any, session: Any) -> None:
        self.settings, self.s = settings, session

    def list_runs(self) -> list[dict[str, Any]]:
        from ckptd.service import catalog

        return catalog.list_runs(self.s)

    def list_nodes(self) -> list[dict[str, Any]]:
        from ckptd.service import catalog

        return catalog.list_nodes(self.s, self.settings.node_timeout)

    def list_steps(self, run: str, state: str | None) -> list[dict[str, Any]]:
        from ckptd.service import catalog

        return catalog.list_steps(self.s, run, state)

    def resume(self, run: str, args: argparse.Namespace) -> dict[str, Any]:
        from ckptd.service.resume import NoRestorableStepError, ResumeOptions, resume

        opts = ResumeOptions(args.max_step, args.world_size, args.skip_spikes, lease=not args.no_lease,
                             exclude_unreachable=args.exclude_unreachable, node_timeout=self.settings.node_timeout,
                             hardlinks=self.settings.allow_hardlinks)
        try:
            return resume(self.s, run, opts)
        except NoRestorableStepError as err:
            raise NoAnswer({**err.to_dict(), "skipped": err.skipped}) from None  # type: ignore[attr-defined]

    def allow_hardlinks(self) -> bool:
        return bool(self.settings.allow_hardlinks)


def _quote(run: str) -> str:
    import urllib.parse

    return urllib.parse.quote(run, safe="")


def _detail(err: Exception) -> dict[str, Any] | None:
    """ckptd's error body ``{"detail": {code, message, hint, ...}}`` of an ``HTTPError``, or None."""
    import http.client

    try:
        doc = json.loads(err.read())
    except (ValueError, OSError, http.client.HTTPException):
        return None
    detail = doc.get("detail") if isinstance(doc, dict) else None
    return detail if isinstance(detail, dict) and isinstance(detail.get("code"), str) else None
