"""The shared secret that authenticates every frame between nodes.

A secret comes from, in this order of precedence:

* ``EXECUTOR_CHANNEL_SECRET``: the secret itself, hex encoded;
* ``EXECUTOR_CHANNEL_SECRET_FILE``: the path of a file that holds the hex secret and that
  only its owner may read (``chmod 600``);
* :meth:`Secret.generate`: a fresh random secret, for a driver that starts its own workers
  and hands the secret to them (:meth:`Secret.to_env`).

Setting both variables is an error rather than a silent choice: two sources that disagree
would make some nodes unable to talk to others, which is harder to diagnose than a refusal.
"""

from __future__ import annotations

import binascii
import hashlib
import os
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

import attrs

__all__ = [
    "ENV_SECRET",
    "ENV_SECRET_FILE",
    "MIN_SECRET_BYTES",
    "Secret",
    "SecretError",
]

#: Environment variable that holds the hex-encoded secret.
ENV_SECRET = "EXECUTOR_CHANNEL_SECRET"
#: Environment variable that names a file holding the hex-encoded secret.
ENV_SECRET_FILE = "EXECUTOR_CHANNEL_SECRET_FILE"
#: The shortest secret accepted, in bytes once decoded: HMAC-SHA256 gets its full strength
#: from a key at least as long as its output.
MIN_SECRET_BYTES = 32
#: A secret file larger than this is not a hex secret (a wrong path, most likely); reading
#: stops there instead of loading a large file into memory.
_MAX_FILE_BYTES = 64 * 1024


class SecretError(ValueError):
    """A secret could not be read: the message says what was wrong and what to do."""


@attrs.frozen(repr=False)
class Secret:
    """A shared secret of at least :data:`MIN_SECRET_BYTES` random bytes.

    :meth:`load` reads the one a job's processes share from the environment: :attr:`ENV`
    (``EXECUTOR_CHANNEL_SECRET``, hex) or :attr:`ENV_FILE` (``EXECUTOR_CHANNEL_SECRET_FILE``,
    a file of mode 600 holding it).

    Its ``repr`` hides the key, so logging a ``Secret`` never leaks it; :attr:`fingerprint`
    identifies it in logs (two nodes whose fingerprints differ hold different secrets).
    """

    #: Environment variable holding the hex-encoded secret.
    ENV = ENV_SECRET
    #: Environment variable that names a file holding the hex-encoded secret.
    ENV_FILE = ENV_SECRET_FILE

    key: bytes = attrs.field(validator=attrs.validators.instance_of(bytes))

    def __attrs_post_init__(self) -> None:
        if len(self.key) < MIN_SECRET_BYTES:
            raise SecretError(
                f"the channel secret is {len(self.key)} bytes long; it must be at least "
                f"{MIN_SECRET_BYTES} random bytes (generate one with "
                f"`python -c 'import secrets; print(secrets.token_hex({MIN_SECRET_BYTES}))'`)"
            )

    def __repr__(self) -> str:
        return f"Secret(fingerprint={self.fingerprint!r})"

    @classmethod
    def generate(cls) -> Secret:
        """A fresh random secret (:data:`MIN_SECRET_BYTES` bytes from :mod:`secrets`)."""
        return cls(secrets.token_bytes(MIN_SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, *, source: str = "the secret") -> Secret:
        """Decode a hex secret; surrounding whitespace (a trailing newline) is ignored.

        ``source`` names where the text came from, for the error message.
        """
        stripped = text.strip()
        if not stripped:
            raise SecretError(
                f"{source} is empty; set it to at least {MIN_SECRET_BYTES} random bytes in "
                f"hex (`python -c 'import secrets; print(secrets.token_hex({MIN_SECRET_BYTES}))'`)"
            )
        try:
            key = binascii.unhexlify(stripped)
        except (binascii.Error, ValueError):
            raise SecretError(
                f"{source} is not hex: it must hold an even number of the characters "
                f"0-9 and a-f only (got {len(stripped)} characters); "
                f"generate one with `python -c 'import secrets; "
                f"print(secrets.token_hex({MIN_SECRET_BYTES}))'`"
            ) from None
        if len(key) < MIN_SECRET_BYTES:
            raise SecretError(
                f"{source} decodes to {len(key)} bytes; it must be at least "
                f"{MIN_SECRET_BYTES} bytes ({2 * MIN_SECRET_BYTES} hex characters)"
            )
        return cls(key)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Secret:
        """Read a hex secret from ``path``, refusing a file that group or others may read.

        The mode is checked on the opened file (``fstat``), so the file checked is the file
        read.
        """
        where = Path(path)
        try:
            fd = os.open(where, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise SecretError(
                f"cannot open the channel secret file {str(where)!r}: {exc.strerror}"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise SecretError(f"the channel secret file {str(where)!r} is not a regular file")
            if info.st_mode & 0o077:
                raise SecretError(
                    f"the channel secret file {str(where)!r} may be read by other users "
                    f"(mode {stat.S_IMODE(info.st_mode):o}); restrict it to its owner with "
                    f"`chmod 600 {where}`"
                )
            data = b""
            while len(data) <= _MAX_FILE_BYTES:
                chunk = os.read(fd, _MAX_FILE_BYTES + 1 - len(data))
                if not chunk:
                    break
                data += chunk
        finally:
            os.close(fd)
        if len(data) > _MAX_FILE_BYTES:
            raise SecretError(
                f"the channel secret file {str(where)!r} is larger than {_MAX_FILE_BYTES} "
                "bytes: it should hold only the hex secret"
            )
        try:
            text = data.decode("ascii")
        except UnicodeDecodeError:
            raise SecretError(
                f"the channel secret file {str(where)!r} is not text: it must hold the secret "
                "in hex"
            ) from None
        return cls.from_hex(text, source=f"the channel secret file {str(where)!r}")

    @property
    def fingerprint(self) -> str:
        """A short, non-secret identifier of this key, for logs and error messages."""
        digest = hashlib.sha256(b"executor-channel fingerprint\x00" + self.key).hexdigest()
        return digest[:12]

    def hex(self) -> str:
        """The key in hex, as :data:`ENV_SECRET` expects it."""
        return self.key.hex()

    def to_env(self) -> dict[str, str]:
        """Environment entries that hand this secret to a child process.

        Any process of the same user can read another's environment (``/proc/<pid>/environ``),
        so a secret passed this way is as private as that user's account.
        """
        return {ENV_SECRET: self.hex()}

    @classmethod
    def load(cls, environ: Mapping[str, str] | None = None, *, generate: bool = False) -> Secret:
        """The secret named by the environment, or a fresh one if ``generate`` and none is set.

        Reads :data:`ENV_SECRET` or :data:`ENV_SECRET_FILE` from ``environ`` (default
        :data:`os.environ`). Raises :class:`SecretError` when both are set, when the value is
        malformed, or when neither is set and ``generate`` is false.
        """
        env = os.environ if environ is None else environ
        value = env.get(ENV_SECRET)
        path = env.get(ENV_SECRET_FILE)
        if value is not None and path is not None:
            raise SecretError(
                f"both {ENV_SECRET} and {ENV_SECRET_FILE} are set; set only one of them"
            )
        if value is not None:
            return cls.from_hex(value, source=f"the environment variable {ENV_SECRET}")
        if path is not None:
            if not path.strip():
                raise SecretError(f"{ENV_SECRET_FILE} is set but empty; set it to a file path")
            return cls.from_file(path)
        if generate:
            return cls.generate()
        raise SecretError(
            f"no channel secret: set {ENV_SECRET} to at least {MIN_SECRET_BYTES} random bytes in "
            f"hex, or {ENV_SECRET_FILE} to a file (mode 600) that holds them"
        )
