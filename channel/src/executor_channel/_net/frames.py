"""The signed frame: one zmq multipart message, authenticated before anything reads its payload.

A frame is the multipart message ``[header, chunks of part_1, ..., chunks of part_n, mac]``:
each payload part travels as one zmq part, or, when it is longer than the sender's
:attr:`Limits.chunk_bytes`, as several consecutive zmq parts of at most that size (zero-copy
slices of it). No zmq part a holder of the secret sends is larger than that or than the header,
so a receiver refuses larger ones in zmq itself (``MAXMSGSIZE``), before they are buffered.
A *compact* frame, one of at most :data:`COMPACT_AT_MOST` bytes in all (and at most
``chunk_bytes``), travels instead as the one zmq part ``header || part_1 || ... || part_n ||
mac``: every zmq part costs a message through zmq's pipes and a frame object on both ends, and
most frames are small. The receiver cuts it into the same views (:func:`read_frame`, which
checks its sizes against the header first), and the MAC is the same either way.

``header`` is :data:`HEADER_FIXED` (big-endian) followed by ``n`` lengths (u64 each):

==========  ======  ==============================================================
field       bytes   meaning
==========  ======  ==============================================================
magic       4       ``b"EXCH"``: not one of ours otherwise
version     1       :data:`VERSION`; any other value is dropped
kind        1       :class:`Kind`
(padding)   2       zero
session     16      the sender's session id (random per connection or listener)
epoch       16      the nonce the *receiver* issued for this session (zero in HELLO)
sequence    8       per session and direction, strictly increasing from 1
count       4       ``n``, the number of payload parts
lengths     8 * n   the length of each payload part
==========  ======  ==============================================================

``mac`` is a GMAC tag (16 bytes): AES-256-GCM over an empty plaintext, with ``header ||
part_1 || ... || part_n`` as its associated data, under a key for the session and the
direction, ``HMAC-SHA256(secret, key label || direction label || session || epoch ||
salt)``, and with the sequence as its nonce. The direction is in the key, so a frame cannot
be reflected back to its sender. A nonce never repeats under one key: the sender increments
the sequence for every frame of a session and direction, and every session has keys of its
own. To the listener, the epoch is the listener's nonce for the session (zero in HELLO, one
per dialer's session), and the salt is empty. To the dialer, the header's session and epoch
are the listener's lifetime id and the dialer's nonce, which a replayed HELLO would bring
back for a new session of the listener's: so the salt is the listener's nonce for the
session, new for each (the dialer reads it from the WELCOME's one part, then checks the
WELCOME's tag under it). (GMAC is
SP 800-38D's MAC; with unique nonces it is as strong as AES-GCM's tags. It reads a payload
several times faster than HMAC-SHA256, which each side would otherwise pay on every byte.)
The lengths are in the authenticated header because the parts are authenticated back to
back: without them ``[b"ab", b"c"]`` and ``[b"a", b"bc"]`` would carry the same MAC.

Guarantees of :func:`parse_header` followed by :func:`verify`: a frame is accepted only if its
zmq parts between the header and the MAC add up, in order, to exactly the declared lengths of
its ``count`` payload parts (a part of length 0 is one empty zmq part), no declared length
exceeds the :class:`Limits`, and its MAC matches under the shared secret (compared in constant
time with :func:`hmac.compare_digest`). Every check on sizes runs before a payload byte is
read. Freshness (the sequence and the epoch) is the link's job: see :mod:`.link`.

Here too: a frame's tag (:func:`tag`, GMAC under a key of its session and direction, as
constructed above) and a link's :class:`Limits` (bounds on what it accepts and queues).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
import struct
from collections.abc import Sequence
from typing import NamedTuple

import attrs
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

__all__ = [
    "COMPACT_AT_MOST",
    "HEADER_FIXED",
    "MAC_BYTES",
    "NONCE_BYTES",
    "VERSION",
    "ZERO_NONCE",
    "Direction",
    "DropReason",
    "FrameError",
    "Header",
    "Kind",
    "Limits",
    "Pieces",
    "check_fresh",
    "joined",
    "parse_header",
    "payload_chunks",
    "read_frame",
    "seal",
    "tag",
    "tag_joined",
    "verify",
]

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
    # times faster than an HMAC (see this module's docstring).
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


def _positive(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


def _positive_seconds(instance: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0 < value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number of seconds > 0, got {value}")


@attrs.frozen
class Limits:
    """Bounds on what a link accepts and queues; a frame beyond them is dropped unread.

    Before a peer has passed the gate (:mod:`.gate`: zmq's handshake, in which it proves it
    holds the secret), zmq accepts no message from it: a connection can make this side hold
    at most one zmq part of at most ``chunk_bytes``, for at most ``handshake_s``, and at most
    ``max_pending`` connections are kept in that state at once. After the gate, zmq refuses
    any part above ``chunk_bytes`` (and disconnects its sender) and queues at most ``hwm``
    messages each way; the link drops a message whose parts exceed ``max_parts`` or
    ``max_part_bytes``. Both ends of a link should use the same limits: a part above the
    receiver's ``chunk_bytes`` costs the sender its connection.
    """

    #: Most payload parts in one message.
    max_parts: int = attrs.field(default=1024, validator=_positive)
    #: Largest payload part, in bytes (it may travel as several chunks).
    max_part_bytes: int = attrs.field(default=1 << 30, validator=_positive)
    #: zmq high-water mark (messages queued) for sending and for receiving.
    hwm: int = attrs.field(default=1000, validator=_positive)
    #: Most sessions a listener keeps (the least recently active goes first).
    max_peers: int = attrs.field(default=1024, validator=_positive)
    #: Largest zmq part sent or accepted: a longer payload part travels as several. It is
    #: what one connection that has not passed the gate can make a listener hold; a larger
    #: value saves the receiver one copy of parts up to that size.
    chunk_bytes: int = attrs.field(default=1 << 20, validator=_positive)
    #: How long a connection may take over zmq's handshake (the gate) before zmq drops it.
    handshake_s: float = attrs.field(default=10.0, validator=_positive_seconds)
    #: Most connections a listener keeps in zmq's handshake at once; newer ones are cut.
    max_pending: int = attrs.field(default=32, validator=_positive)


MAGIC = b"EXCH"

# 2: payload parts longer than a chunk travel as several zmq parts. 3: GMAC tags.
VERSION = 4

NONCE_BYTES = 16

MAC_BYTES = 16

ZERO_NONCE = bytes(NONCE_BYTES)

#: magic, version, kind, padding, session, epoch, sequence, part count.
HEADER_FIXED = struct.Struct("!4sBBxx16s16sQI")

_LENGTH = struct.Struct("!Q")

_MAX_SEQUENCE = (1 << 64) - 1

#: A payload part as it arrived: one zmq part, or its chunks in order.
Pieces = tuple[memoryview, ...]


class Kind(enum.IntEnum):
    """What a frame carries."""

    #: dialer -> listener: opens a session; its one part is the dialer's nonce.
    HELLO = 1
    #: listener -> dialer: accepts a session; its one part is the listener's nonce for it.
    WELCOME = 2
    #: either way: a caller's message.
    DATA = 3
    #: dialer -> listener: the dialer closes its session.
    BYE = 4


_KIND_OF = {int(kind): kind for kind in Kind}


class DropReason(enum.StrEnum):
    """Why a received frame was dropped (the keys of a link's ``drops`` counter)."""

    #: Too few parts, not our magic, a header too short, or a MAC of the wrong size.
    MALFORMED = "malformed"
    UNKNOWN_VERSION = "unknown_version"
    UNKNOWN_KIND = "unknown_kind"
    #: The part count or a part's length differs from the header (truncated or padded).
    BAD_LENGTHS = "bad_lengths"
    #: The header declares more parts or longer parts than the limits allow.
    TOO_LARGE = "too_large"
    #: The session is not open here (closed, evicted, or from another listener's lifetime).
    UNKNOWN_SESSION = "unknown_session"
    #: The frame binds a nonce this receiver did not issue for the session.
    WRONG_EPOCH = "wrong_epoch"
    #: The sequence number is not above the last one accepted from the session.
    REPLAYED = "replayed"
    #: The MAC does not match: no secret, the wrong secret, or altered bytes.
    BAD_MAC = "bad_mac"
    #: Authentic in form but out of place (a WELCOME sent to a listener, for instance).
    UNEXPECTED = "unexpected"
    #: A connection refused in zmq's own handshake, before it could send a message: its gate
    #: token is missing or not made with the secret (see :mod:`.gate`).
    GATE = "gate"
    #: A connection cut while still in zmq's handshake: more than ``Limits.max_pending``
    #: connections were in it at once.
    PENDING = "pending"


class FrameError(Exception):
    """A received frame is not acceptable; :attr:`reason` says why."""

    def __init__(self, reason: DropReason) -> None:
        super().__init__(reason.value)
        self.reason = reason


class Header(NamedTuple):
    """A parsed header; its fields mean what the module docstring says. (A named tuple:
    one is made for every frame received.)"""

    kind: Kind
    session: bytes
    epoch: bytes
    sequence: int
    #: The declared length of each payload part.
    lengths: tuple[int, ...]
    #: How many zmq parts (chunks) each payload part arrived in.
    spans: tuple[int, ...]


@functools.lru_cache(maxsize=64)
def _lengths(count: int) -> struct.Struct:
    """The header's ``count`` part lengths."""
    return struct.Struct(f"!{count}Q")


def seal(
    key: bytes,
    direction: Direction,
    kind: Kind,
    *,
    session: bytes,
    epoch: bytes,
    sequence: int,
    parts: Sequence[memoryview],
    chunk_bytes: int | None = None,
    salt: bytes = b"",
) -> list[bytes | bytearray | memoryview]:
    """The frame ``[header, *chunks, mac]`` carrying ``parts`` (byte-format memoryviews),
    each part cut into zero-copy slices of at most ``chunk_bytes`` (whole if ``None``); or,
    if the whole frame is at most :data:`COMPACT_AT_MOST` (and ``chunk_bytes``), the one
    part ``header || parts || mac`` (:func:`read_frame` cuts it again).
    ``salt`` goes into the MAC's key (see the module docstring)."""
    if len(session) != NONCE_BYTES or len(epoch) != NONCE_BYTES:
        raise ValueError(f"session and epoch must be {NONCE_BYTES} bytes each")
    if not 1 <= sequence <= _MAX_SEQUENCE:
        raise ValueError(f"sequence out of range: {sequence}")
    count = len(parts)
    sizes = [part.nbytes for part in parts]
    header = HEADER_FIXED.pack(MAGIC, VERSION, kind, session, epoch, sequence, count)
    if count:
        header += _lengths(count).pack(*sizes)
    total = len(header) + sum(sizes)
    if total + MAC_BYTES <= min(COMPACT_AT_MOST, chunk_bytes or COMPACT_AT_MOST):
        # Small: one zmq part, the header, the parts and the tag back to back.
        data = bytearray().join((header, *parts))
        data += tag_joined(key, direction, session, epoch, sequence, salt, data)
        return [data]
    mac = tag(key, direction, session, epoch, sequence, salt, header, parts, total)
    if chunk_bytes is None or not count or max(sizes) <= chunk_bytes:
        return [header, *parts, mac]
    frames: list[bytes | bytearray | memoryview] = [header]
    for part in parts:
        if part.nbytes <= chunk_bytes:
            frames.append(part)
        else:
            frames.extend(part[i : i + chunk_bytes] for i in range(0, part.nbytes, chunk_bytes))
    frames.append(mac)
    return frames


def _fixed_fields(header: memoryview, limits: Limits) -> tuple[Kind, bytes, bytes, int, int]:
    """The kind, session, epoch, sequence and part count of a header at least
    :data:`HEADER_FIXED` long, checked: our magic, our version, a known kind, and at most
    ``limits.max_parts`` parts."""
    magic, version, kind, session, epoch, sequence, count = HEADER_FIXED.unpack_from(header)
    if magic != MAGIC:
        raise FrameError(DropReason.MALFORMED)
    if version != VERSION:
        raise FrameError(DropReason.UNKNOWN_VERSION)
    known = _KIND_OF.get(kind)
    if known is None:
        raise FrameError(DropReason.UNKNOWN_KIND)
    if count > limits.max_parts:
        raise FrameError(DropReason.TOO_LARGE)
    return known, session, epoch, sequence, count


def read_frame(frames: list[memoryview], limits: Limits) -> tuple[Header, list[memoryview]]:
    """A received frame checked as :func:`parse_header` checks it, and its views
    ``[header, *parts, mac]``: a frame that came as one zmq part (a compact frame, see
    :func:`seal`) is cut into zero-copy views of those, by the sizes its header declares, in
    the same pass as the checks; any other is checked by :func:`parse_header` and returned
    as it came. Raises :class:`FrameError` with the reason of the first check that fails."""
    if len(frames) != 1:
        return parse_header(frames, limits), frames
    data = frames[0]
    size = data.nbytes
    if size < HEADER_FIXED.size + MAC_BYTES or size > COMPACT_AT_MOST:
        raise FrameError(DropReason.MALFORMED)
    known, session, epoch, sequence, count = _fixed_fields(data, limits)
    front = HEADER_FIXED.size + _LENGTH.size * count
    if size < front + MAC_BYTES:
        raise FrameError(DropReason.BAD_LENGTHS)
    lengths: tuple[int, ...] = _lengths(count).unpack_from(data, HEADER_FIXED.size)
    if front + sum(lengths) + MAC_BYTES != size:
        raise FrameError(DropReason.BAD_LENGTHS)
    if count and max(lengths) > limits.max_part_bytes:
        raise FrameError(DropReason.TOO_LARGE)
    views = [data[:front]]
    at = front
    for length in lengths:
        views.append(data[at : at + length])
        at += length
    views.append(data[at:])
    return Header(known, session, epoch, sequence, lengths, (1,) * count), views


def parse_header(frames: Sequence[memoryview], limits: Limits) -> Header:
    """Check a received frame's structure against its header and ``limits``.

    Reads only the header and the sizes of the parts, never a payload byte. Raises
    :class:`FrameError` with the reason of the first check that fails.
    """
    if len(frames) < 2:
        raise FrameError(DropReason.MALFORMED)
    header = frames[0]
    if header.nbytes < HEADER_FIXED.size:
        raise FrameError(DropReason.MALFORMED)
    known, session, epoch, sequence, count = _fixed_fields(header, limits)
    if header.nbytes != HEADER_FIXED.size + _LENGTH.size * count or len(frames) < count + 2:
        raise FrameError(DropReason.BAD_LENGTHS)
    if frames[-1].nbytes != MAC_BYTES:
        raise FrameError(DropReason.MALFORMED)
    lengths: tuple[int, ...] = _lengths(count).unpack_from(header, HEADER_FIXED.size)
    if len(frames) == count + 2:
        # The common case: each part came whole, one zmq part each (as it must, then).
        index = 1
        for declared in lengths:
            if declared > limits.max_part_bytes:
                raise FrameError(DropReason.TOO_LARGE)
            if frames[index].nbytes != declared:
                raise FrameError(DropReason.BAD_LENGTHS)
            index += 1
        return Header(known, session, epoch, sequence, lengths, (1,) * count)
    spans = []
    chunks = len(frames) - 1
    index = 1
    for declared in lengths:
        if declared > limits.max_part_bytes:
            raise FrameError(DropReason.TOO_LARGE)
        # The zmq parts of one payload part: consecutive, non-empty unless the part is.
        first = index
        total = 0
        while True:
            if index >= chunks:
                raise FrameError(DropReason.BAD_LENGTHS)
            size = frames[index].nbytes
            index += 1
            total += size
            if total >= declared or size == 0:
                break
        if total != declared:
            raise FrameError(DropReason.BAD_LENGTHS)
        spans.append(index - first)
    if index != chunks:
        raise FrameError(DropReason.BAD_LENGTHS)
    return Header(known, session, epoch, sequence, lengths, tuple(spans))


def payload_chunks(frames: Sequence[memoryview], header: Header) -> tuple[Pieces, ...]:
    """Each payload part of a checked frame as the zmq parts it came in: zero-copy views,
    one for a part that came whole, several for one that came in chunks."""
    chunks = []
    index = 1
    for span in header.spans:
        chunks.append(tuple(frames[index : index + span]))
        index += span
    return tuple(chunks)


def joined(pieces: Pieces) -> memoryview:
    """A payload part from its pieces: the one view itself, or several joined into a new
    buffer (one copy)."""
    if len(pieces) == 1:
        return pieces[0]
    return memoryview(b"".join(pieces))


def verify(
    key: bytes, direction: Direction, frames: Sequence[memoryview], salt: bytes = b""
) -> bool:
    """Whether the MAC of a frame that passed :func:`parse_header` is right (constant time),
    under the key ``salt`` was sealed with."""
    header, parts = frames[0], frames[1:-1]
    _, _, _, session, epoch, sequence, _ = HEADER_FIXED.unpack_from(header)
    total = header.nbytes + sum(part.nbytes for part in parts)
    expected = tag(key, direction, session, epoch, sequence, salt, header, parts, total)
    return hmac.compare_digest(expected, frames[-1])


def check_fresh(
    key: bytes,
    direction: Direction,
    frames: Sequence[memoryview],
    header: Header,
    epoch: bytes,
    last_sequence: int,
    salt: bytes = b"",
    whole: memoryview | None = None,
) -> None:
    """Raise :class:`FrameError` unless a frame that passed :func:`parse_header` binds
    ``epoch`` (the nonce this side issued), comes after ``last_sequence``, and carries a
    right MAC (under ``salt``'s key). The MAC is checked last: a stale frame is dropped
    whatever its MAC, so a replay flood costs no hashing. ``whole`` is the one zmq part a
    compact frame came as (:func:`read_frame` cut ``frames`` from it): its bytes before the
    MAC are tagged as they are, not joined again."""
    if header.epoch != epoch:
        raise FrameError(DropReason.WRONG_EPOCH)
    if header.sequence <= last_sequence:
        raise FrameError(DropReason.REPLAYED)
    if whole is not None:
        signed = whole.nbytes - MAC_BYTES
        expected = tag_joined(
            key, direction, header.session, epoch, header.sequence, salt, whole[:signed]
        )
    else:
        header_view = frames[0]
        total = header_view.nbytes + sum(header.lengths)
        expected = tag(
            key,
            direction,
            header.session,
            epoch,
            header.sequence,
            salt,
            header_view,
            frames[1:-1],
            total,
        )
    if not hmac.compare_digest(expected, frames[-1]):
        raise FrameError(DropReason.BAD_MAC)
