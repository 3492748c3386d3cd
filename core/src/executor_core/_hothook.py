"""Direct calls of a hook's implementations on a hot path (a call's observers).

Why: pluggy's general hook call (argument checks, the wrapper protocol, a result list) costs
more per call than a cheap observer costs itself, and an engine that installs a metrics plugin
pays it on every call. For a hook whose implementations are all plain functions, the same
functions can be called directly, with the same arguments, in the same order as pluggy would
(:class:`HotHook`). As soon as one implementation is a wrapper, pluggy's own call is used.

Plugins may be registered or removed at any time: every :meth:`HotHook.active` compares the
hook's implementations with those it has seen (pluggy's own list, which pluggy changes in place,
so the check allocates nothing), and rebuilds the direct calls when they changed. pluggy's call
tracing (``PluginManager.add_hookcall_monitoring``) does not see direct calls.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pluggy

__all__ = ["HotHook", "live_impls"]


class _AskImpls:
    """Stands for pluggy's list of a hook's implementations where it is not reachable."""

    __slots__ = ("_caller",)

    def __init__(self, caller: pluggy.HookCaller) -> None:
        self._caller = caller

    def __bool__(self) -> bool:
        return bool(self._caller.get_hookimpls())


def live_impls(caller: pluggy.HookCaller) -> Any:
    """Something true exactly while ``caller`` has implementations, as cheap to test as can be:
    pluggy's own list (changed in place as plugins come and go), else a stand-in that asks."""
    impls = getattr(caller, "_hookimpls", None)
    if isinstance(impls, list):
        return impls
    return _AskImpls(caller)  # pragma: no cover - a pluggy without the list


class HotHook:
    """One hook, called with positional values in the order of its specification's arguments.

    Call :meth:`active` first, then call the object if it returned True.
    """

    __slots__ = ("_argnames", "_caller", "_direct", "_live", "_seen")

    def __init__(self, caller: pluggy.HookCaller) -> None:
        spec = caller.spec
        if spec is None:
            raise ValueError(f"hook {caller.name!r} has no specification")
        self._caller = caller
        live = live_impls(caller)
        #: pluggy's own list of the implementations, or None where it is not reachable.
        self._live: list[pluggy.HookImpl] | None = live if isinstance(live, list) else None
        self._argnames: tuple[str, ...] = tuple(spec.argnames)
        self._seen: list[pluggy.HookImpl] = []
        # (function, indices of the values it takes, or None for all of them), in call order;
        # None while an implementation is a wrapper (pluggy calls them all).
        self._direct: list[tuple[Callable[..., Any], tuple[int, ...] | None]] | None = []

    def active(self) -> bool:
        """True if any plugin implements the hook now."""
        impls = self._live if self._live is not None else self._caller.get_hookimpls()
        if impls != self._seen:
            self._rebuild(impls)
        return bool(impls)

    def __call__(self, *values: Any) -> None:
        """Call every implementation (as of the last :meth:`active`) with ``values``."""
        direct = self._direct
        if direct is None:
            self._caller(**dict(zip(self._argnames, values, strict=True)))
            return
        for function, indices in direct:
            if indices is None:
                function(*values)
            else:
                function(*[values[i] for i in indices])

    def _rebuild(self, impls: Sequence[pluggy.HookImpl]) -> None:
        self._seen = list(impls)
        if any(impl.wrapper or impl.hookwrapper for impl in impls):
            self._direct = None
            return
        position = {name: i for i, name in enumerate(self._argnames)}
        direct: list[tuple[Callable[..., Any], tuple[int, ...] | None]] = []
        for impl in reversed(impls):  # pluggy's order: last registered (and tryfirst) first
            indices = tuple(position[name] for name in impl.argnames)
            full = indices == tuple(range(len(self._argnames)))
            direct.append((impl.function, None if full else indices))
        self._direct = direct
