"""How a fault was written: kept as data, so that ``mutate`` shows detection by origin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from harness.errors import check_one_of, require

_WITH_THE_PROPERTY = "with the property"
_BLIND = "blind"
_NOT_STATED = "not stated"
WRITTEN = (_WITH_THE_PROPERTY, _BLIND, _NOT_STATED)
"""How a fault may have been written, in the order ``mutate``'s table scores them."""


@dataclass(frozen=True, kw_only=True)
class Origin:
    """How a fault was written.

    ``written`` is one of:
    - ``"with the property"``: written beside the property meant to catch it, by someone who
      had read the suites;
    - ``"blind"``: written in a held-out set (``harness.faults.held_out``) from upstream bug
      reports, by someone who had not read the suites;
    - ``"not stated"``: nothing said, the default: a fault file's own fault (``--fault-file``)
      needs no origin, and one without is counted apart from distconf's own.
    """

    written: str = _NOT_STATED
    held_out: str | None = None
    """The held-out set a blind fault was written in; ``None`` for any other."""
    upstream: tuple[str, ...] = ()
    """The upstream reports (http(s) URLs) the fault re-creates: a blind fault names one at
    least."""
    survived_before: bool | None = None
    """Whether a blind fault survived the suites its held-out set was first run against (what
    strengthened them since: ``harness.faults.held_out``); ``None``: not recorded."""

    def __post_init__(self) -> None:
        check_one_of("written", self.written, WRITTEN)
        blind = self.written == _BLIND
        if blind:
            named = isinstance(self.held_out, str) and bool(self.held_out.strip())
            require(named, "held_out", self.held_out, "the name of a blind fault's held-out set")
        else:
            require(self.held_out is None, "held_out", self.held_out, "None unless written blind")
        links = isinstance(self.upstream, tuple) and all(map(_is_url, self.upstream))
        require(links, "upstream", self.upstream, "a tuple of http(s) URLs")
        require(
            bool(self.upstream) or not blind,
            "upstream",
            self.upstream,
            "the upstream report(s) a blind fault re-creates: one http(s) URL at least",
        )
        recorded = self.survived_before is None or (blind and type(self.survived_before) is bool)
        require(
            recorded, "survived_before", self.survived_before, "a bool for a blind fault, else None"
        )

    @property
    def label(self) -> str:
        """How ``mutate``'s table names the origin: ``"blind, DTensor depth set"``."""
        if self.written == _BLIND:
            return f"blind, {self.held_out} set"
        if self.written == _NOT_STATED:
            return "origin not stated"
        return f"written {self.written}"

    def record(self) -> dict[str, Any]:
        """The origin as ``mutation.json`` keeps it, its label included."""
        return {
            "label": self.label,
            "written": self.written,
            "held_out": self.held_out,
            "upstream": list(self.upstream),
            "survived_before": self.survived_before,
        }


def _is_url(value: object) -> bool:
    if not isinstance(value, str):
        return False
    parts = urlsplit(value)
    return parts.scheme in ("http", "https") and bool(parts.netloc) and value.split() == [value]


WITH_THE_PROPERTY = Origin(written=_WITH_THE_PROPERTY)
NOT_STATED = Origin()


def blind(held_out: str, *upstream: str, survived_before: bool | None = None) -> Origin:
    """The origin of a fault written blind in the held-out set ``held_out``, re-creating the
    upstream reports ``upstream``."""
    return Origin(
        written=_BLIND,
        held_out=held_out,
        upstream=upstream,
        survived_before=survived_before,
    )
