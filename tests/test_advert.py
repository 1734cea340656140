"""Where a command finds the daemon of its catalog (ckptd.advert) and which catalog it names
(ckptd.configfile.catalog_url: the same answer as the settings, without pydantic)."""

from __future__ import annotations

import json
import os

import pytest

from ckptd import advert
from ckptd.configfile import catalog_url, default_db_url


@pytest.fixture
def runtime(tmp_path, monkeypatch):
    d = tmp_path / "xdg"
    d.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    for var in ("CKPTD_DB", "CKPTD_CONFIG"):
        monkeypatch.delenv(var, raising=False)
    return d


@pytest.mark.parametrize("flag, env, file, want", [
    (None, None, None, "DEFAULT"),
    ("sqlite:///f.db", "sqlite:///e.db", 'db = "sqlite:///c.db"', "sqlite:///f.db"),
    (None, "sqlite:///e.db", 'db = "sqlite:///c.db"', "sqlite:///e.db"),
    (None, None, 'db = "postgresql+psycopg://u:pw@h/test"', "postgresql+psycopg://u:pw@h/test"),
    (None, None, 'root = "/x"', "DEFAULT"),
])
def test_the_catalog_named_is_the_settings_own(runtime, tmp_path, monkeypatch, flag, env, file, want):
    from ckptd.settings import Settings

    if env:
        monkeypatch.setenv("CKPTD_DB", env)
    if file:
        cfg = tmp_path / "c.toml"
        cfg.write_text(file + "\n")
        monkeypatch.setenv("CKPTD_CONFIG", str(cfg))
    got = catalog_url(flag)
    assert got == (default_db_url() if want == "DEFAULT" else want)
    settings = Settings(**({"db": flag} if flag else {}))
    assert (settings.db or default_db_url()) == got


def test_one_catalog_one_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert advert.catalog_key("sqlite:///c.db") == advert.catalog_key(f"sqlite:///{tmp_path}/c.db")
    assert advert.catalog_key("sqlite:///c.db") != advert.catalog_key("sqlite:///d.db")
    # a password is no part of which database it is, and is never written
    assert advert.normalized("postgresql+psycopg://u:secret@h:5432/test") == "postgresql+psycopg://u@h:5432/test"
    assert advert.catalog_key("postgresql+psycopg://u:a@h/test") == advert.catalog_key("postgresql+psycopg://u:b@h/test")


def test_advertised_found_withdrawn(runtime):
    db = "postgresql+psycopg://u:secret@127.0.0.1/test"
    assert advert.find(db) is None
    path = advert.advertise(db, "http://127.0.0.1:1")
    assert advert.find(db) == "http://127.0.0.1:1" and advert.find("sqlite:///other.db") is None
    raw = open(path).read()
    assert "secret" not in raw and os.stat(path).st_mode & 0o777 == 0o600
    advert.withdraw(path)
    assert not os.path.exists(path) and advert.find(db) is None


def test_a_dead_daemons_or_untrusted_advertisement_is_ignored(runtime):
    db = "sqlite:////tmp/x.db"
    path = advert.advertise(db, "http://127.0.0.1:1")
    doc = json.load(open(path))
    with open(path, "w") as fh:  # a daemon SIGKILLed: its pid is no live process (or a newer one's)
        json.dump({**doc, "start": doc["start"] + 1}, fh)
    assert advert.find(db) is None
    with open(path, "w") as fh:
        json.dump(doc, fh)
    assert advert.find(db) == "http://127.0.0.1:1"
    os.chmod(runtime / "ckptd", 0o777)  # others may write there: not trusted
    assert advert.find(db) is None
    os.chmod(runtime / "ckptd", 0o700)
    os.chown(runtime / "ckptd", 12345, -1)  # another user's
    assert advert.find(db) is None
