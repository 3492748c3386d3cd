"""Direct calls of a hook's implementations on a hot path (a call's observers).

Why: pluggy's general hook call (argument checks, the wrapper protocol, a result list) costs
more per call than a cheap observer costs itself, and an engine that installs a metrics plugin
pays it on every call. For a hook whose implementations are all plain functions, the same
functions can be called directly, with the same arguments, in the same order as pluggy would
(:class:`HotHook`). As soon as one implementation is a wrapper, pluggy's own call is used.

Plugins may be registered or removed at any time: every :meth:`HotHook.current` compares the
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
    Ask :meth:`current` for the function to call, and call it only if it is not None.
    """

    __slots__ = ("_argnames", "_call", "_caller", "_live", "_seen")

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
        #: What :meth:`current` returns as of the implementations in ``_seen``.
        self._call: Callable[..., None] | None = None

    def current(self) -> Callable[..., None] | None:
        """A function that calls every implementation the hook has now, with the values in the
        specification's order, or None while no plugin implements it. A lone implementation
        that takes every argument is returned itself: an observer then costs one call."""
        impls = self._live if self._live is not None else self._caller.get_hookimpls()
        if impls != self._seen:
            self._rebuild(impls)
        return self._call

    def _rebuild(self, impls: Sequence[pluggy.HookImpl]) -> None:
        self._seen = list(impls)
        if not impls:
            self._call = None
            return
        if any(impl.wrapper or impl.hookwrapper for impl in impls):
            caller, argnames = self._caller, self._argnames

            def through_pluggy(*values: Any) -> None:
                caller(**dict(zip(argnames, values, strict=True)))

            self._call = through_pluggy
            return
        position = {name: i for i, name in enumerate(self._argnames)}
        everything = tuple(range(len(self._argnames)))
        direct: list[tuple[Callable[..., Any], tuple[int, ...] | None]] = []
        for impl in reversed(impls):  # pluggy's order: last registered (and tryfirst) first
            indices = tuple(position[name] for name in impl.argnames)
            direct.append((impl.function, None if indices == everything else indices))
        if len(direct) == 1 and direct[0][1] is None:
            self._call = direct[0][0]
            return

        def in_order(*values: Any) -> None:
            for function, indices in direct:
                if indices is None:
                    function(*values)
                else:
                    function(*[values[i] for i in indices])

        self._call = in_order
