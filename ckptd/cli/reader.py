"""Where ``ckptd ls`` and ``ckptd resume`` get their answers: a running daemon, or the catalog itself.

The daemon asked: ``--ckptd-url URL``, else ``$CKPTD_URL`` (the variable the launcher and the
training callback already read) unless ``--db`` is on the command line, else the live ``ckptd
serve`` of this machine that advertises the catalog the command names (:mod:`ckptd.advert`; the
catalog from ``--db`` / ``$CKPTD_DB`` / the config file / the default, :func:`ckptd.configfile.
catalog_url`). ``$CKPTD_TOKEN`` is the bearer token, as for the launcher. A daemon named by the
operator that cannot be asked is an error; an advertised one that cannot (gone meanwhile, no
token for it, another ckptd version) is skipped, and the catalog is opened after all. With no
daemon, the command opens the catalog (SQLAlchemy, the ORM models, pydantic settings, the schema
guard).

Why: opening the catalog costs ~0.5 s of imports before the first query (SQLAlchemy builds its
classes at import), ten times a bare interpreter's start, which a launcher polling ``ckptd resume
--json`` or an operator's shell pays on every call. The daemon's answers are the service's own --
the same functions behind its routes, the resume answer the oracle's body byte for byte -- so
asking it is no second source of truth, and this module imports only the standard library until
the catalog is needed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable, Iterator
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
    p.add_argument("--no-daemon", action="store_true",
                   help="open the catalog here even when a daemon on this machine serves it")


def daemon_url(args: argparse.Namespace) -> tuple[str | None, bool]:
    """(the daemon to ask or None to open the catalog, whether it was found by its advertisement):
    ``--ckptd-url``; none with ``--no-daemon``; else ``$CKPTD_URL`` unless ``--db`` names a catalog
    on the command line (the more specific wish wins); else the daemon advertising the named
    catalog on this machine."""
    url = getattr(args, "ckptd_url", None)
    db = getattr(args, "db", None)
    if url:
        if db:
            err = CkptdError("give --db or --ckptd-url, not both",
                             hint="--db reads a catalog directly; --ckptd-url asks the daemon serving one")
            err.code = "usage"
            raise err
        if getattr(args, "no_daemon", False):
            err = CkptdError("give --ckptd-url or --no-daemon, not both")
            err.code = "usage"
            raise err
        return url, False
    if getattr(args, "no_daemon", False):
        return None, False
    if not db and os.environ.get("CKPTD_URL"):
        return os.environ["CKPTD_URL"], False
    from ckptd import advert
    from ckptd.configfile import catalog_url

    found = advert.find(catalog_url(db))
    return found, found is not None


@contextlib.contextmanager
def reader(args: argparse.Namespace, write: bool = False) -> Iterator[DaemonReader | CatalogReader | AdvertisedReader]:
    """The source of a command's answers (``write``: the catalog session commits, e.g. a resume lease)."""
    url, advertised = daemon_url(args)
    if url is not None and not advertised:
        yield DaemonReader(url)
        return
    with contextlib.ExitStack() as stack:

        def open_catalog() -> CatalogReader:
            from ckptd.cli.catalog_cmds import catalog_sessions

            settings, sessions = catalog_sessions(args)
            return CatalogReader(settings, stack.enter_context(sessions.begin() if write else sessions()))

        yield AdvertisedReader(DaemonReader(url), open_catalog) if url is not None else open_catalog()


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
                 "exclude_unreachable": "true" if args.exclude_unreachable else None, "tiers": args.tiers}
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
            if detail.get("code") in ("unauthorized", "forbidden"):
                raise DaemonError(f"the daemon at {self.url} refused GET {path}: {detail.get('message')}",
                                  hint="set $CKPTD_TOKEN to a token of its read scope, or give --db") from None
            # ckptd's own refusal (no such run, a bad state, a token's scope): what the catalog would say
            raise CkptdError(str(detail.get("message") or f"HTTP {err.code}"), hint=detail.get("hint")) from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", None) or err
            raise DaemonError(f"the daemon at {self.url} could not be asked: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise DaemonError(f"the daemon at {self.url} answered GET {path} with something that is not JSON") from None


class AdvertisedReader:
    """The daemon found by its advertisement, and the catalog once that daemon cannot be asked
    (ckptd's own answers -- no such run, nothing restorable -- are answers, not a reason to fall back)."""

    def __init__(self, daemon: DaemonReader, open_catalog: Callable[[], CatalogReader]) -> None:
        self.daemon, self.open_catalog = daemon, open_catalog
        self.catalog: CatalogReader | None = None

    def ask(self, name: str, *a: Any) -> Any:
        if self.catalog is None:
            try:
                return getattr(self.daemon, name)(*a)
            except DaemonError:
                self.catalog = self.open_catalog()
        return getattr(self.catalog, name)(*a)

    def list_runs(self) -> list[dict[str, Any]]:
        return self.ask("list_runs")

    def list_nodes(self) -> list[dict[str, Any]]:
        return self.ask("list_nodes")

    def list_steps(self, run: str, state: str | None) -> list[dict[str, Any]]:
        return self.ask("list_steps", run, state)

    def resume(self, run: str, args: argparse.Namespace) -> dict[str, Any]:
        return self.ask("resume", run, args)

    def allow_hardlinks(self) -> bool:
        return self.ask("allow_hardlinks")


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

        from ckptd.states import Tier

        try:
            tiers = tuple(Tier(t) for t in dict.fromkeys(args.tiers.split(",")))
        except ValueError:
            raise CkptdError(f"--tiers {args.tiers!r}: the tiers are file, memory and object") from None
        opts = ResumeOptions(args.max_step, args.world_size, args.skip_spikes, lease=not args.no_lease,
                             exclude_unreachable=args.exclude_unreachable, node_timeout=self.settings.node_timeout,
                             hardlinks=self.settings.allow_hardlinks, tiers=tiers,
                             memory_root=str(self.settings.memory_root) if self.settings.memory_root else None)
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
