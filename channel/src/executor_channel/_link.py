"""Authenticated links between nodes, as the package imports them: a :class:`Listener` (zmq
ROUTER) and its dialers.

A :class:`Connection` (zmq DEALER) opens a session with a handshake, then both sides exchange
messages, each a sequence of bytes-like parts. The link never unpickles anything: it hands
the caller only parts whose frame passed every check of :mod:`._frames` and the freshness
checks below. Frames that fail are dropped, counted per :class:`DropReason` (``drops``), and
logged through ``logging.getLogger("executor_channel")``: one warning for the first drop from
each peer (a zmq connection), debug records after that. A peer's bytes never raise out of
``recv``.

The package takes the link's names from here; the link itself is made of
:mod:`._link_types` (its vocabulary), :mod:`._link_end` (what both ends share),
:mod:`._drops` (the drop account), :mod:`._listener` and :mod:`._connection`.

Handshake (all frames signed, see :mod:`._frames`)::

    dialer                                         listener (epoch id L, random per bind)
      HELLO   session=S epoch=0 seq=1 [C]  ---->   new session S; picks nonce N (random)
              <----  WELCOME session=L epoch=C seq=1 [N]
      DATA    session=S epoch=N seq=2,3,...  ---->
              <----  DATA    session=L epoch=C seq=2,3,...
      BYE     session=S epoch=N seq=k  ---->       forgets session S

``S`` and ``C`` are random per :class:`Connection`; ``N`` is random per session and per
listener lifetime. Guarantees, for anyone who does not hold the secret:

* *Authenticity*: a frame is delivered only if its MAC verifies under the secret, and a MAC
  binds the direction, so a listener's frame cannot be reflected back to it.
* *No replay within a session*: a frame is delivered only if its sequence number is above the
  last one delivered from that session; a dialer never sends a second HELLO, so a replayed
  HELLO for an open session is dropped too.
* *No replay across sessions or lifetimes*: frames from a dialer bind ``N``, which this
  listener issued for this session; frames from a listener bind ``C``, which this dialer
  picked. A frame captured in an earlier session or from an earlier listener (even one on
  the same port with the same secret) is dropped as ``unknown_session`` or ``wrong_epoch``.
  A replayed HELLO (it binds no nonce) at most opens a session that no one can use: its
  WELCOME goes to the replayer, who cannot sign for ``N``; it holds one slot until evicted.
* Frames are authenticated, **not encrypted**: an observer of the network reads payloads.

Neither class is thread-safe (nor is a zmq socket): use each from one thread at a time. A
listener answers handshakes inside :meth:`Listener.recv`, so its owner should call ``recv``
while dialers connect. ``drops`` may be read from any thread.
"""

from ._connection import Connection
from ._link_types import BytesLike, ChannelError, ChannelTimeoutError, Message, PeerId
from ._listener import LOOPBACK, Listener

__all__ = [
    "LOOPBACK",
    "BytesLike",
    "ChannelError",
    "ChannelTimeoutError",
    "Connection",
    "Listener",
    "Message",
    "PeerId",
]
