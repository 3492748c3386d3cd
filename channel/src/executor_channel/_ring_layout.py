"""Where a ring lies in the segment: its counters' lines, then its slots, each opened by a
chunk header.

Layout of a ring inside the segment (counters are native-endian u64, each on its own
64-byte line)::

    +0                   written: chunks published by the writer
    +8                   writer_waiting: set while the writer waits for a free slot
    +64 * (1 + i)        consumed[i]: chunks reader i has finished with
    slots_offset + k*S   slot k: chunk header (message bytes, chunk bytes) then data, or
                         the header (WITHDRAWN, 0): the message before it was withdrawn

What the writer and the readers do with the counters is the counter protocol of
:mod:`._ring`.
"""

from __future__ import annotations

import struct

import attrs

__all__ = ["CHUNK", "LINE", "SLOT_HEADER", "WITHDRAWN", "RingLayout"]

#: A slot's chunk header: the message's bytes, and the bytes of it in this chunk.
CHUNK = struct.Struct("<QQ")
#: Each counter's line.
LINE = 64
#: Where a slot's data starts.
SLOT_HEADER = 64
#: A chunk header's message bytes that mean: the message this slot continues was withdrawn
#: (its writer stopped part-way, see RingWriter.write): readers drop what they have of it.
WITHDRAWN = (1 << 64) - 1


@attrs.frozen
class RingLayout:
    """Where a ring lives in the segment and how it is shaped."""

    offset: int
    readers: int
    slots: int
    slot_bytes: int

    @property
    def slots_offset(self) -> int:
        return self.offset + _align(LINE * (1 + self.readers), 4096)

    @property
    def slot_stride(self) -> int:
        return _align(SLOT_HEADER + self.slot_bytes, 4096)

    @property
    def nbytes(self) -> int:
        return self.slots_offset - self.offset + self.slots * self.slot_stride


def _align(value: int, to: int) -> int:
    return (value + to - 1) // to * to
