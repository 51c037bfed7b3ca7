"""What a run says about torch's known deviations: the triage of a torch release.

Each test record falls in one category (or none: passed, skipped):

==============  ==============================================================================
category        the test
==============  ==============================================================================
``new``         failed (error, timeout, crash) where no deviation is known
``different``   failed in a spec with a known deviation, but not as the deviation does (its
                fingerprint or exception class did not match): the spec changed behaviour
``fixed``       passed where a deviation was expected (strict): fixed in this torch
``unverified``  failed as the known deviation does, on a torch it was not verified on
``known``       failed as the known deviation does, on a torch it was verified on
==============  ==============================================================================

``harness.outcome.verdict`` gives each its own exit code; the summary, the report's "Versions"
section and ``harness expectations check`` list them per spec.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

CATEGORIES = ("new", "different", "fixed", "unverified", "known")
"""Worst first."""
UNEXPECTED = ("new", "different", "fixed")
"""The categories that are unexpected outcomes: a test a person must look at."""
TO_REVIEW = (*UNEXPECTED, "unverified")
"""The categories that keep a run from being green."""
TITLES = {
    "new": "new failures",
    "different": "changed behaviour: a different failure in a spec with a known deviation",
    "fixed": "deviations fixed: an expected failure passed",
    "unverified": "known deviations still present, not yet verified on this torch",
    "known": "known deviations still present",
}
_FAILED = ("failed", "error", "timeout", "crashed")


def category(record: Mapping[str, Any]) -> str | None:
    """The category of one test record (None: it passed, skipped, or may pass)."""
    status = record.get("status")
    expected = record.get("expectation") or None
    if expected is None:
        return "new" if status in _FAILED or status == "xpassed" else None
    if status in _FAILED:
        return "different"
    if status == "xpassed":
        return None if expected.get("status") == "flaky" else "fixed"
    if status == "xfailed":
        return "known" if expected.get("verified_here", True) else "unverified"
    return None


@dataclass(frozen=True)
class Seen:
    """One test as the triage sees it."""

    category: str | None
    spec: str
    nodeid: str
    expectation: str | None
    """The expectation's ``file.toml #n``."""
    verified: tuple[str, ...]


def seen(record: Mapping[str, Any]) -> Seen:
    """A results record as the triage sees it."""
    expected = record.get("expectation") or {}
    return Seen(
        category=category(record),
        spec=str(record.get("spec") or "(no spec)"),
        nodeid=str(record.get("nodeid")),
        expectation=expected.get("source"),
        verified=tuple(expected.get("verified") or ()),
    )


@dataclass(frozen=True)
class Finding:
    """One spec's tests of one category (under one expectation)."""

    spec: str
    category: str
    tests: tuple[str, ...]
    expectation: str | None
    verified: tuple[str, ...]


def findings(tests: Iterable[Seen]) -> list[Finding]:
    """The run's findings, worst category first, then by spec."""
    grouped: dict[tuple[str, str, str | None], list[Seen]] = defaultdict(list)
    for test in tests:
        if test.category is not None:
            grouped[(test.category, test.spec, test.expectation)].append(test)
    listed = [
        Finding(spec, found, tuple(t.nodeid for t in group), source, group[0].verified)
        for (found, spec, source), group in grouped.items()
    ]
    return sorted(listed, key=lambda f: (CATEGORIES.index(f.category), f.spec))


def counts_of(categories: Iterable[str | None]) -> dict[str, int]:
    """Tests per category, every category present, worst first."""
    tally = dict.fromkeys(CATEGORIES, 0)
    for found in categories:
        if found is not None:
            tally[found] += 1
    return tally


def meaning(finding: Finding, torch: str) -> str:
    """What a finding means for ``torch``, in words."""
    where = f" ({finding.expectation})" if finding.expectation else ""
    seen = ", ".join(finding.verified) or "no release"
    return {
        "new": "fails: no known deviation",
        "different": f"fails otherwise than its known deviation{where}",
        "fixed": f"fixed in {torch}: its deviation{where} did not happen",
        "unverified": f"known (verified on {seen}){where}",
        "known": f"known deviation{where}",
    }[finding.category]


def describe(finding: Finding, torch: str) -> str:
    """One line for a finding: its spec, what it means for ``torch``, how many tests."""
    return f"{finding.spec}: {meaning(finding, torch)} [{len(finding.tests)} test(s)]"


def releases(headers: Iterable[Mapping[str, Any] | None]) -> list[str]:
    """The torch releases results headers name, each once, in order."""
    named = (h.get("torch") for h in headers if h is not None)
    return list(dict.fromkeys(release(str(v)) for v in named if v))


def release(version: str) -> str:
    """A torch version without its local build tag (``2.15.0+cpu`` -> ``2.15.0``)."""
    try:
        return Version(version).public
    except InvalidVersion:
        return version
