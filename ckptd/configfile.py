"""Where settings come from before pydantic sees them: the config file (``CKPTD_CONFIG``, TOML or
JSON) and the embedded catalog's default path. Standard library only, so a command that needs just
"which catalog?" (``ckptd ls`` finding the daemon that serves it, :mod:`ckptd.advert`) answers it
without loading pydantic. :class:`ckptd.settings.Settings` reads the file through
:func:`read_config_file`; :func:`catalog_url` is its precedence for ``db`` (flag > ``CKPTD_DB`` >
file > default), kept equal to it by tests/test_advert.py."""

from __future__ import annotations

import json
import os
from typing import Any

from ckptd.errors import CkptdError

DEFAULT_DB_PATH = os.path.join(os.path.expanduser("~"), ".local", "share", "ckptd", "catalog.db")


class ConfigError(CkptdError):
    code = "config"
    default_hint = "see `ckptd config show` and docs/CONFIG.md"


def read_config_file() -> dict[str, Any]:
    """The values of the file named by ``CKPTD_CONFIG`` ({} when none is named)."""
    path = os.environ.get("CKPTD_CONFIG")
    if not path:
        return {}
    try:
        with open(path, "rb") as fh:
            raw = fh.read()
        if path.endswith(".json"):
            return json.loads(raw)
        import tomllib

        return tomllib.loads(raw.decode())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file: {exc}", path=path) from None


def default_db_url() -> str:
    return f"sqlite:///{DEFAULT_DB_PATH}"


def catalog_url(flag: str | None = None) -> str:
    """The catalog a command names: ``--db``, else ``$CKPTD_DB``, else the config file's ``db``,
    else the embedded default."""
    if flag:
        return flag
    env = os.environ.get("CKPTD_DB")
    if env:
        return env
    return read_config_file().get("db") or default_db_url()
