"""What a plugin or a backend needs installed, checked against what is: the executor-core
version a plugin's distribution requires, and a backend's :attr:`BackendSpec.requires`.

Markers are evaluated for this interpreter with no extra selected (a requirement that only an
optional extra pulls in does not apply); pre-releases satisfy a range, so that a development
build of the core does not reject every plugin.
"""

from __future__ import annotations

import importlib.metadata

import attrs
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

__all__ = ["Incompatibility", "check_core_requirement", "core_requirement", "unmet"]


@attrs.frozen
class Incompatibility:
    """A plugin's requirement on executor-core that the installed core does not meet."""

    #: The requirement, e.g. ``"executor-core>=0.2,<0.3"``.
    requirement: str
    #: The installed executor-core version.
    installed: str

    def describe(self) -> str:
        """``"requires executor-core>=0.2,<0.3; installed 0.1.0"``."""
        return f"requires {self.requirement}; installed {self.installed}"


def _applies(req: Requirement) -> bool:
    return req.marker is None or req.marker.evaluate({"extra": ""})


def _core_version() -> str:
    """The installed executor-core version (the source tree's when it is not installed)."""
    try:
        return importlib.metadata.version("executor-core")
    except importlib.metadata.PackageNotFoundError:
        from ._version import __version__

        return __version__


def core_requirement(dist: importlib.metadata.Distribution | None) -> str:
    """What ``dist`` requires of executor-core here, e.g. ``"executor-core>=0.1,<0.2"``:
    every requirement on executor-core that applies, combined; ``""`` when there is none (or
    none with a version range)."""
    specifier = SpecifierSet()
    for line in (dist.requires or []) if dist is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue  # not ours to judge; pip would have refused it
        if canonicalize_name(req.name) == "executor-core" and _applies(req):
            specifier &= req.specifier
    return f"executor-core{specifier}" if str(specifier) else ""


def check_core_requirement(requirement: str) -> Incompatibility | None:
    """``None`` when the installed executor-core meets ``requirement`` (PEP 508; ``""``
    always does), else what is wrong."""
    if not requirement:
        return None
    req = Requirement(requirement)
    installed = _core_version()
    if req.specifier.contains(installed, prereleases=True):
        return None
    return Incompatibility(f"executor-core{req.specifier}", installed)


def unmet(requirement: str) -> tuple[str, str]:
    """``(requirement to install, what is wrong)``; what is wrong is ``""`` when it is met.

    The requirement to install drops the marker: it applies here, and pip takes the rest.
    """
    req = Requirement(requirement)
    if not _applies(req):
        return requirement, ""
    req.marker = None
    try:
        installed = importlib.metadata.version(req.name)
    except importlib.metadata.PackageNotFoundError:
        return str(req), "not installed"
    if req.specifier.contains(installed, prereleases=True):
        return str(req), ""
    return str(req), f"{installed} installed"
