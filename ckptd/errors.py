"""The one exception tree of ckptd.

Every error a user can provoke with bad input is a :class:`CkptdError` leaf that carries *what*
went wrong, *where* (path, byte offset when known) and a *hint* telling the operator what to do.
Edges (CLI, API) print ``str(err)``; they never show a traceback for these.
"""

from __future__ import annotations

import os


class CkptdError(Exception):
    """Root of every ckptd error. ``code`` is a stable machine-readable name (used in JSON)."""

    code = "error"
    default_hint = ""

    def __init__(
        self,
        message: str,
        *,
        path: str | os.PathLike[str] | None = None,
        offset: int | None = None,
        hint: str | None = None,
    ) -> None:
        self.message = message
        self.path = os.fspath(path) if path is not None else None
        self.offset = offset
        self.hint = hint if hint is not None else self.default_hint
        super().__init__(str(self))

    def with_path(self, path: str | os.PathLike[str]) -> "CkptdError":
        """Attach the file path when a lower layer raised without knowing it."""
        if self.path is None:
            self.path = os.fspath(path)
            self.args = (str(self),)
        return self

    def __str__(self) -> str:
        where = self.path or ""
        if self.offset is not None:
            where = f"{where} @ byte {self.offset}" if where else f"byte {self.offset}"
        text = f"{where}: {self.message}" if where else self.message
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def to_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "message": self.message,
            "path": self.path,
            "offset": self.offset,
            "hint": self.hint,
        }


# --- file format -----------------------------------------------------------------------------


class FormatError(CkptdError):
    """A checkpoint file cannot be read as the format it claims to be."""

    code = "format"


class UnknownFormatError(FormatError):
    code = "unknown_format"
    default_hint = "expected a MindSpore .ckpt (protobuf, optionally encrypted) or .safetensors file"


class TruncatedError(FormatError):
    code = "truncated"
    default_hint = (
        "the file ends early: the save was probably interrupted; "
        "use an older checkpoint or re-save this one"
    )


class CorruptError(FormatError):
    code = "corrupt"
    default_hint = "the file's bytes are damaged; restore it from a replica or use an older checkpoint"


class ChecksumMismatchError(CorruptError):
    code = "checksum_mismatch"
    default_hint = "the CRC does not match the content: the file was modified or damaged after saving"


class UnsupportedDtypeError(FormatError):
    code = "unsupported_dtype"
    default_hint = "this dtype is not one MindSpore writes to checkpoints; was the file produced by MindSpore?"


# --- encryption ------------------------------------------------------------------------------


class EncryptionError(CkptdError):
    code = "encryption"


class KeyRequiredError(EncryptionError):
    code = "key_required"
    default_hint = "the file is encrypted; pass the raw key bytes with --key-file"


class NotEncryptedError(EncryptionError):
    code = "not_encrypted"
    default_hint = "the file is plaintext although a key was given; drop --key-file or check the save's enc_key"


class InvalidKeyError(EncryptionError):
    code = "invalid_key"
    default_hint = "AES keys are 16, 24 or 32 raw bytes; SM4 keys are 16 raw bytes (the key file holds the bytes, not hex)"


class WrongKeyError(EncryptionError):
    code = "wrong_key"
    default_hint = "the key does not decrypt this file; check the key file matches the enc_key used when saving"


class AuthenticationError(EncryptionError):
    code = "authentication_failed"
    default_hint = "an AES-GCM block failed authentication: the ciphertext was modified or damaged"


class PaddingError(EncryptionError):
    code = "bad_padding"
    default_hint = "a CBC block has invalid padding: the ciphertext was modified, damaged or truncated"


# --- strategy / layout -----------------------------------------------------------------------


class StrategyError(CkptdError):
    code = "malformed_strategy"
    default_hint = "pass a strategy file saved by MindSpore (strategy_ckpt_config save_file), protobuf or .json"


class LayoutError(CkptdError):
    code = "layout"
    default_hint = "the tensor's shape does not fit the strategy's device matrix and tensor map"
