"""Configuration: flags > environment (``CKPTD_*``) > config file (``CKPTD_CONFIG``, TOML/JSON) > defaults."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from ckptd.configfile import ConfigError, read_config_file
from ckptd.atomic import TMP_SUFFIX
from ckptd.runlayout import NODE_MARKER_PREFIX
from ckptd.storage import PosixStorage


#: A node's sharing marker is the file ``<root>/.ckptd-node-<name>`` (runlayout.node_marker_path),
#: written through the temp name ``<marker>.<pid>.ckptd-tmp`` (ckptd.atomic; a pid has at most 7
#: digits, pid_max <= 2**22): that must fit a file name (NAME_MAX, 255 bytes), so a node name has
#: at most 225 characters (the pattern admits ASCII only: characters are bytes).
NODE_NAME_MAX = 255 - len(NODE_MARKER_PREFIX) - len(".4194304") - len(TMP_SUFFIX)


def token_problem(token: str) -> str | None:
    """Why ``token`` cannot be a bearer token, or None. A token is what follows ``Bearer `` in a
    header: at least one visible ASCII character, no spaces or control characters. An empty one
    would make a token set look configured (so ``serve`` would listen beyond loopback) while no
    request can ever present it."""
    if not token:
        return "a token is empty"
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        return "a token has a space, a control or a non-ASCII character"
    return None


class _FileSource(PydanticBaseSettingsSource):
    """Values from the file named by CKPTD_CONFIG (lowest priority after defaults)."""

    def get_field_value(self, field, field_name):  # noqa: ANN001 - pydantic API
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return read_config_file()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="CKPTD_", extra="forbid")

    root: Path = Field(default=Path("checkpoints"), description="checkpoint root: <root>/<run>/rank_<r>/...")
    db: str | None = Field(default=None, description="catalog URL; default sqlite under ~/.local/share/ckptd")
    key_file: Path | None = Field(default=None, description="raw encryption key bytes (never stored in the catalog)")
    key_hex: str | None = Field(default=None, repr=False, description="encryption key as hex (environment only)")
    require_encryption: bool = Field(default=False, description="a plaintext shard is a policy violation")
    require_crc: bool = Field(default=False, description="a .ckpt shard without CRC trailer is invalid")
    world_size: int | None = Field(default=None, description="expected ranks when no strategy file says")
    verify_workers: int = Field(default=2, ge=1, le=64)
    replica_check: Literal["off", "sample", "full"] = "sample"
    replica_sample: int = Field(default=8, ge=1, description="parameters compared per step in sample mode")
    rescan_interval: float = Field(default=30.0, gt=0)
    debounce: float = Field(default=0.05, ge=0)
    settle_seconds: float = Field(default=2.0, ge=0, description="writable files must be unchanged this long")
    watch_backend: Literal["auto", "inotify", "watchdog"] = Field(
        default="auto", description="file events: ckptd's inotify reader (Linux; auto) or a watchdog observer",
    )
    host: str = Field(default="127.0.0.1", description="API listen address")
    port: int = Field(default=8470, ge=0, le=65535)
    access_log: bool = Field(default=False, description="log every HTTP request (costs ~0.1 ms of CPU a request)")
    tokens: dict[str, Literal["read", "report", "admin"]] = Field(
        default_factory=dict, repr=False, description='bearer tokens: {"<token>": "read"|"report"|"admin"}'
    )
    token_file: Path | None = Field(default=None, description="lines '<scope> <token>'; scopes read, report, admin")
    # on by default: restarts leave earlier incarnations' files (net-*, net_1-*, ...) that the job's
    # own keep_checkpoint_max never rotates, and torn temp files of killed saves
    gc_keep_last: int | None = Field(default=5, ge=0, description="background retention: keep the newest N restorable "
                                                               "steps of every run, all incarnations (0: off)")
    gc_keep_every: int | None = Field(default=None, ge=1)
    gc_interval: float = Field(default=300.0, gt=0)
    gc_torn_grace: float = Field(default=3600.0, gt=0, description="retention removes a shard save's temp file "
                                                                  "(net-2_6.tmp) untouched this long (s)")
    node_name: str = Field(
        default_factory=lambda: socket.gethostname() or "localhost", min_length=1, max_length=NODE_NAME_MAX,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
        description="this daemon's node (default: the host name); it owns the files it sees, see docs/ARCHITECTURE.md",
    )
    node_timeout: float = Field(
        default=120.0, gt=0, description="a node whose daemon sent no heartbeat for this long is 'unreachable' (s)",
    )
    heartbeat_interval: float = Field(default=10.0, gt=0, description="how often this daemon renews its heartbeat (s)")
    worker_stall_seconds: float = Field(
        default=300.0, gt=0, description="/healthz is unhealthy when a busy worker made no progress for this long (s)",
    )
    allow_hardlinks: bool = Field(
        default=False, description="read files below the root that have more than one hard link (refused by default)",
    )
    memory_root: Path | None = Field(
        default=Path("/dev/shm/ckptd"),
        description="the memory tier (flash checkpoints): jobs' snapshots in this node's shared memory; "
                    "this daemon catalogues the slots of runs under its root (null: off)",
    )
    persist_every: int = Field(default=50, ge=0, description="memory tier: write every N-th global step's snapshot "
                                                            "as a checkpoint file in the run's layout (0: never)")
    memory_scan_interval: float = Field(default=0.02, gt=0, description="memory tier: how often commit words are read (s): a slot lives two snapshots")
    memory_scrub_after: float = Field(default=300.0, gt=0, description="memory tier: a slot unchanged this long is "
                                                                       "hashed again (damage -> corrupt) (s)")
    memory_release_after: float = Field(default=3600.0, gt=0, description="memory tier: a run's slots unchanged this "
                                                                         "long (no live job) are released (s)")
    object_store: str | None = Field(
        default=None, description="the object tier: s3://BUCKET/PREFIX (endpoint, region and credentials from "
                                  "AWS_ENDPOINT_URL, AWS_REGION, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or the shared "
                                  "credentials file; never in this file); null: off",
    )
    upload_every: int = Field(default=1, ge=1, description="object tier: upload every N-th verified step (global step)")
    object_scrub_interval: float = Field(default=0.0, ge=0, description="object tier: read back every object at "
                                                                       "least this often (s); 0 = off")
    object_keep_last: int | None = Field(default=None, ge=1, description="object tier retention: keep the newest N "
                                                                        "steps whole there (null with object_keep_every "
                                                                        "null: keep all)")
    object_keep_every: int | None = Field(default=None, ge=1, description="object tier retention: keep every N-th step")
    object_gc_interval: float = Field(default=300.0, gt=0, description="object tier retention: runs after the tier "
                                                                      "changed (a manifest written, a step deleted), "
                                                                      "else at least this often (s)")
    scrub_interval: float = Field(
        default=0.0, ge=0,
        description="re-read every verified shard at least this often (s) to catch bit rot; 0 = off",
    )

    @field_validator("tokens", mode="after")
    @classmethod
    def _usable_tokens(cls, v: dict[str, str]) -> dict[str, str]:
        for token in v:
            problem = token_problem(token)
            if problem:  # never the token itself in the message: it may be a real one with a typo
                raise ValueError(f"{problem}: every key of tokens must be a usable bearer token")
        return v

    @field_validator("object_store", mode="after")
    @classmethod
    def _s3_url(cls, v: str | None) -> str | None:
        if v is not None:
            from ckptd.storage.s3 import parse_url

            return str(parse_url(v))  # a clear error at start, not at the first upload
        return v

    @field_validator("root", mode="after")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @classmethod
    def settings_customise_sources(cls, settings_cls, init_settings, env_settings, dotenv_settings, file_secret_settings):  # noqa: ANN001
        return init_settings, env_settings, _FileSource(settings_cls)

    @property
    def storage(self) -> PosixStorage:
        """The checkpoint root as ckptd's services reach it: confined, with this ``allow_hardlinks``."""
        return PosixStorage(str(self.root), self.allow_hardlinks)

    def encryption_key(self) -> bytes | None:
        if self.key_file is not None:
            from ckptd.format.crypto import load_key_file

            return load_key_file(self.key_file)
        if self.key_hex:
            try:
                return bytes.fromhex(self.key_hex)
            except ValueError:
                raise ConfigError("CKPTD_KEY_HEX is not hex") from None
        return None

    def verification_stamp(self) -> str:
        """What a shard verdict depends on besides the file: the key and the CRC/encryption
        policies (a digest; the key itself is never stored). Verdicts record it, and a daemon with
        another stamp re-verifies them (a wrong key must not condemn a run for good)."""
        import hashlib

        key = self.encryption_key() or b""
        body = b"\0".join([hashlib.sha256(key).digest() if key else b"", b"crc" if self.require_crc else b"",
                           b"enc" if self.require_encryption else b""])
        return hashlib.sha256(body).hexdigest()[:32]

    def all_tokens(self) -> dict[str, str]:
        """Token -> scope from ``tokens`` and ``token_file`` (read at start; never logged)."""
        found = dict(self.tokens)
        if self.token_file is not None:
            try:
                lines = self.token_file.read_text().splitlines()
            except OSError as exc:
                raise ConfigError(f"cannot read token file: {exc.strerror}", path=str(self.token_file)) from None
            for n, line in enumerate(lines, 1):
                if not line.strip() or line.lstrip().startswith("#"):
                    continue
                parts = line.split()
                if len(parts) != 2 or parts[0] not in ("read", "report", "admin"):
                    raise ConfigError(f"line {n}: expected '<read|report|admin> <token>'", path=str(self.token_file))
                problem = token_problem(parts[1])
                if problem:
                    raise ConfigError(f"line {n}: {problem}", path=str(self.token_file))
                found[parts[1]] = parts[0]
        return found

    def public_dict(self) -> dict[str, Any]:
        data = self.model_dump(mode="json")
        data["key_hex"] = "***" if self.key_hex else None
        data["tokens"] = {scope: "***" for scope in sorted(set(self.tokens.values()))}
        return data
