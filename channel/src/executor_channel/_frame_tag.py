"""A frame's tag: GMAC under a key of its session and direction (the construction is in
:mod:`._frames`' docstring, and why a nonce never repeats)."""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import struct
from collections.abc import Sequence

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = ["COMPACT_AT_MOST", "Direction", "tag", "tag_joined"]

_KEY_LABEL = b"executor-channel/3 frame key\x00"
# The nonce: the sequence, big-endian, in GCM's 12 bytes.
_NONCE = struct.Struct("!4xQ")
#: Up to this many bytes, a frame is joined and tagged in one call (the cheapest for small
#: frames), and sent as one zmq part; a larger one is fed to GCM part by part, without a
#: copy. Both give the same tag.
COMPACT_AT_MOST = 64 << 10


class Direction(enum.Enum):
    """Which way a frame travels; its label separates the MAC domains of the two ways."""

    TO_LISTENER = b"executor-channel/1 dialer->listener\x00"
    TO_DIALER = b"executor-channel/1 listener->dialer\x00"


@functools.lru_cache(maxsize=4096)
def _session_key(
    key: bytes, direction: Direction, session: bytes, epoch: bytes, salt: bytes
) -> tuple[bytes, AESGCM]:
    """The AES-256 key of one session and direction, and its GCM: derived once per session
    (a listener keeps at most ``Limits.max_peers`` sessions, so the cache covers them)."""
    material = _KEY_LABEL + direction.value + session + epoch + salt
    derived = hmac.new(key, material, hashlib.sha256).digest()
    return derived, AESGCM(derived)


def tag(
    key: bytes,
    direction: Direction,
    session: bytes,
    epoch: bytes,
    sequence: int,
    salt: bytes,
    header: memoryview | bytes,
    parts: Sequence[memoryview],
    total: int,
) -> bytes:
    """The tag of a frame given the header's fields and the frame's ``total`` bytes, as the
    sender and a receiver that parsed the header know them."""
    # Authenticating reads every payload byte once more, on each side; GMAC does it several
    # times faster than an HMAC (see :mod:`._frames`' docstring).
    if total <= COMPACT_AT_MOST:
        data = b"".join((header, *parts))
        return tag_joined(key, direction, session, epoch, sequence, salt, data)
    derived, _ = _session_key(key, direction, session, epoch, salt)
    nonce = _NONCE.pack(sequence)
    encryptor = Cipher(algorithms.AES(derived), modes.GCM(nonce)).encryptor()
    encryptor.authenticate_additional_data(header)
    for part in parts:
        if part.nbytes:
            encryptor.authenticate_additional_data(part)
    encryptor.finalize()
    return encryptor.tag


def tag_joined(
    key: bytes,
    direction: Direction,
    session: bytes,
    epoch: bytes,
    sequence: int,
    salt: bytes,
    data: bytes | bytearray | memoryview,
) -> bytes:
    """The tag of a small frame whose header and parts are ``data``, back to back."""
    _, gcm = _session_key(key, direction, session, epoch, salt)
    result: bytes = gcm.encrypt(_NONCE.pack(sequence), b"", data)
    return result
