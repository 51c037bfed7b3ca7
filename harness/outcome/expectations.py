"""Known deviations of torch from the specs: ``specs/expectations/*.toml``.

Each ``[[expect]]`` entry names a spec ID, the conditions under which torch deviates from it
(torch version range, runner, device, the process group's backend, world size), what to do
(``xfail``: the test must fail, and passing is reported as an unexpected pass; ``skip``: do
not run, for deviations that hang or crash; ``flaky``: may fail or pass), why, and an
upstream link. A deviation never hides a failure without its reason: the reason and link
travel into the results record.

An entry pins the deviation, not the spec: its ``fingerprint`` (a regular expression) must be
found in the failure's text, else the failure is a different one and fails the test
(``harness.plugin.deviations``). A fingerprint any failure could hold (one found in the empty
text, a bare ``AssertionError``, ``SystemExit: 0``, a rank failure's header, ...:
``neutral_failures``) is refused, as are a ``link`` that is not an http(s) URL and a ``flaky``
entry that does not say in ``flaky_because`` why the deviation shows on some draws only.
``torch`` is the range the deviation applies to, open-ended until a release fixes it;
``verified`` lists the releases on which someone saw it. On a torch outside ``verified`` a
matching failure is a known deviation still to be verified there (``harness.outcome.triage``), and
``harness expectations update`` records the verification.
"""

from __future__ import annotations

import functools
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

# ExpectationError is re-exported: callers catch ``expectations.ExpectationError``.
from harness.errors import ExpectationError as ExpectationError
from harness.errors import check_one_of, fail, raised_as, require

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "specs" / "expectations"
STATUSES = ("xfail", "skip", "flaky")
_REQUIRED = ("spec", "status", "reason", "link")
_CONDITIONS = ("torch", "runner", "device", "backend", "world_size", "params")
_OPTIONAL = (*_CONDITIONS, "raises", "example", "fingerprint", "verified", "flaky_because")
_RUNS = ("xfail", "flaky")
"""Statuses whose test runs, so that its failure can be checked against the fingerprint."""


@dataclass(frozen=True)
class Expectation:
    spec: str
    status: str
    reason: str
    link: str
    source: str
    """``file.toml #n``: where the entry is."""
    torch: SpecifierSet | None = None
    runner: tuple[str, ...] = ()
    device: tuple[str, ...] = ()
    backend: tuple[str, ...] = ()
    """Process-group backends (``threaded`` for the thread runner's): a deviation of a
    vendor's backend is recorded against it."""
    world_size: tuple[int, ...] = ()
    params: tuple[str, ...] = ()
    """Values of the test's own parameters (the op of an ops-suite test, say): the entry
    holds for a test with one of them; for every test of its spec when empty."""
    raises: tuple[str, ...] = ()
    """Exception class names the deviation shows as; any other failure stays a failure."""
    example: str = ""
    fingerprint: re.Pattern[str] | None = None
    """Found in the text of the known failure (``failure_text``); None only for ``skip``."""
    verified: tuple[str, ...] = ()
    """The torch releases on which the deviation was seen."""
    flaky_because: str = ""
    """Why the deviation shows on some draws and not on others (``flaky`` only)."""

    def verified_on(self, torch: str) -> bool:
        """Whether the deviation was seen on this torch (its local build tag aside)."""
        here = Version(torch).public
        return any(Version(v).public == here for v in self.verified)

    def recognises(self, failure: str) -> bool:
        """Whether ``failure`` (``failure_text`` of an exception) is this deviation."""
        return self.fingerprint is None or self.fingerprint.search(failure) is not None

    def matches(
        self,
        *,
        spec: str,
        runner: str,
        device: str,
        backend: str,
        world_size: int,
        torch: str,
        params: Sequence[str] = (),
    ) -> bool:
        from harness.runners.base import answers_to

        return (
            spec == self.spec
            and (self.torch is None or Version(torch) in self.torch)
            and (not self.runner or answers_to(runner, self.runner))
            and (not self.device or device in self.device)
            and (not self.backend or backend in self.backend)
            and (not self.world_size or world_size in self.world_size)
            and (not self.params or any(p in self.params for p in params))
        )

    def as_record(self, torch: str) -> dict[str, Any]:
        """The entry as a results record keeps it, for a run on ``torch``."""
        conditions = {
            "torch": str(self.torch) if self.torch is not None else None,
            "runner": list(self.runner) or None,
            "device": list(self.device) or None,
            "backend": list(self.backend) or None,
            "world_size": list(self.world_size) or None,
            "params": list(self.params) or None,
        }
        return {
            "status": self.status,
            "reason": self.reason,
            "link": self.link,
            "source": self.source,
            "conditions": {k: v for k, v in conditions.items() if v is not None},
            "fingerprint": self.fingerprint.pattern if self.fingerprint else None,
            "verified": list(self.verified),
            "verified_here": self.verified_on(torch),
            **({"flaky_because": self.flaky_because} if self.flaky_because else {}),
        }

    def seen(self, torch: str) -> str:
        """Where the deviation was seen, said for a run on ``torch``."""
        on = ", ".join(self.verified)
        return f"verified on {on}" if self.verified_on(torch) else f"verified on {on}, not {torch}"


def load(directory: Path = DEFAULT_DIR) -> list[Expectation]:
    """Every entry of every ``*.toml`` in ``directory``; a directory that is not there is an
    error (a mistyped path must not read as "torch has no known deviation")."""
    if not directory.is_dir():
        raise ExpectationError(
            f"expectations directory {str(directory)!r} does not exist: it must be a directory "
            "of *.toml known-deviation files (distconf_expectations; an empty directory means "
            "no known deviations)"
        )
    entries: list[Expectation] = []
    for path in sorted(directory.glob("*.toml")):
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ExpectationError(f"{path}: not valid TOML: {exc}") from None
        for index, entry in enumerate(data.get("expect", [])):
            entries.append(_parse(entry, f"{path.name} #{index + 1}"))
    return entries


def _parse(entry: Mapping[str, Any], source: str) -> Expectation:
    unknown = sorted(set(entry) - {*_REQUIRED, *_OPTIONAL})
    if unknown:
        raise ExpectationError(f"{source}: unknown fields {unknown}")
    missing = [f for f in _REQUIRED if not isinstance(entry.get(f), str) or not entry.get(f)]
    if missing:
        raise ExpectationError(f"{source}: needs non-empty string fields {missing}")
    with raised_as(ExpectationError, source):
        check_one_of("status", entry["status"], STATUSES)
        fingerprint = _fingerprint(entry)
        return Expectation(
            spec=entry["spec"],
            status=entry["status"],
            reason=entry["reason"],
            link=_link(entry["link"]),
            source=source,
            torch=_specifier(entry.get("torch")),
            runner=_strings(entry, "runner"),
            device=_strings(entry, "device"),
            backend=_strings(entry, "backend"),
            world_size=_ints(entry, "world_size"),
            params=_strings(entry, "params"),
            raises=_strings(entry, "raises"),
            example=str(entry.get("example", "")),
            fingerprint=fingerprint,
            verified=_versions(entry),
            flaky_because=_flaky_because(entry),
        )


def _fingerprint(entry: Mapping[str, Any]) -> re.Pattern[str] | None:
    value = entry.get("fingerprint")
    if value is None:
        require(
            entry["status"] not in _RUNS,
            "fingerprint",
            value,
            f"a regular expression found in the known failure's text (status {entry['status']!r} "
            "runs the test, so its failure must be told apart from other failures)",
        )
        return None
    require(
        isinstance(value, str) and value.strip() != "", "fingerprint", value, "a non-empty string"
    )
    try:
        pattern = re.compile(value, re.DOTALL)
    except re.error as exc:
        fail("fingerprint", value, f"a valid regular expression ({exc})")
    for what, text in neutral_failures():
        if pattern.search(text) is not None:
            fail(
                "fingerprint",
                value,
                "a regular expression found in the known failure's text and not in any "
                f"failure's: it matches {what} ({text[:80]!r})",
            )
    return pattern


def _link(value: str) -> str:
    parts = urlsplit(value)
    ok = parts.scheme in ("http", "https") and bool(parts.netloc) and value.split() == [value]
    require(ok, "link", value, "an http(s) URL of the upstream issue or of the source that does it")
    return value


def _flaky_because(entry: Mapping[str, Any]) -> str:
    value = entry.get("flaky_because")
    if entry["status"] != "flaky":
        require(
            value is None,
            "flaky_because",
            value,
            f"absent: only a 'flaky' entry says why it shows on some draws (status is "
            f"{entry['status']!r})",
        )
        return ""
    ok = isinstance(value, str) and value.strip() != ""
    what = "why the deviation shows on some draws and not on others (a 'flaky' test may pass)"
    require(ok, "flaky_because", value, f"a non-empty string saying {what}")
    return str(value)


def _versions(entry: Mapping[str, Any]) -> tuple[str, ...]:
    value = entry.get("verified")
    what = "a non-empty list of the torch releases the deviation was seen on, e.g. ['2.13.0']"
    if not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        fail("verified", value, what)
    for version in value:
        try:
            Version(version)
        except InvalidVersion:
            fail("verified", value, f"{what}; {version!r} is not a version")
    return tuple(value)


def _specifier(value: Any) -> SpecifierSet | None:
    if value is None:
        return None
    try:
        return SpecifierSet(str(value))
    except InvalidSpecifier:
        fail("torch", value, "a version range such as '>=2.13,<2.14'")


def _strings(entry: Mapping[str, Any], field: str) -> tuple[str, ...]:
    value = entry.get(field, [])
    ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    require(ok, field, value, "a list of strings")
    return tuple(value)


def _ints(entry: Mapping[str, Any], field: str) -> tuple[int, ...]:
    value = entry.get(field, [])
    ok = isinstance(value, list) and all(isinstance(v, int) and v > 0 for v in value)
    require(ok, field, value, "a list of positive ints")
    return tuple(value)


def find(
    expectations: Sequence[Expectation],
    *,
    spec: str,
    runner: str,
    device: str,
    backend: str,
    world_size: int,
    torch: str,
    params: Sequence[str] = (),
) -> Expectation | None:
    """The entry for one test (``params``: the values of its own parameters); two entries
    matching one test is an error (which wins?)."""
    found = [
        e
        for e in expectations
        if e.matches(
            spec=spec,
            runner=runner,
            device=device,
            backend=backend,
            world_size=world_size,
            torch=torch,
            params=params,
        )
    ]
    if len(found) > 1:
        sources = ", ".join(e.source for e in found)
        raise ExpectationError(
            f"{sources} all match spec {spec!r} on {runner}/{device}/{backend}/world size "
            f"{world_size} with torch {torch}: narrow their conditions so one applies"
        )
    return found[0] if found else None


def failure_text(exc: BaseException) -> str:
    """The text a fingerprint is searched in: each exception of ``exc`` (the leaves of an
    exception group) as ``Type: message``; a ``RankFailure``'s message holds every rank's.
    An exception without a message (``exc``, or what it was raised from: a rank's, under a
    ``RankFailure``) adds the line it was raised at, as a traceback names it, so that a bare
    ``AssertionError`` in torch can be told from one elsewhere."""
    if isinstance(exc, BaseExceptionGroup):
        return "\n".join(failure_text(inner) for inner in exc.exceptions)
    text = f"{type(exc).__name__}: {exc}"
    for bare in (exc, exc.__cause__):
        if bare is not None and not str(bare) and bare.__traceback__ is not None:
            text += f"\n{type(bare).__name__} with no message, raised at:\n{_raised_at(bare)}"
    return text


def _raised_at(exc: BaseException) -> str:
    last = exc.__traceback__
    while last is not None and last.tb_next is not None:
        last = last.tb_next
    assert last is not None, "called for an exception with a traceback"
    code = last.tb_frame.f_code
    return f'  File "{code.co_filename}", line {last.tb_lineno}, in {code.co_name}'


@functools.cache
def neutral_failures() -> tuple[tuple[str, str], ...]:
    """Failure texts any failure may have (and what each is): a fingerprint found in one of
    them would take an unrelated failure, a wrong value or a rank's exit, for the deviation.
    The rank failures are ``RankFailure``'s own texts, so that they follow its wording."""
    from harness.runners.base import RankFailure, RankOutcome, error_outcome

    def raised(exc: BaseException) -> BaseException:
        try:
            raise exc
        except BaseException as caught:
            return caught

    def rank_failure(runner: str, *outcomes: RankOutcome, deadline: float | None = None) -> str:
        failure = RankFailure(outcomes, runner=runner, device="cpu", deadline=deadline)
        failure.__cause__ = failure.primary.exception  # as the runners raise it
        return failure_text(failure)

    stack = (
        '  File "/site-packages/harness/runners/_rank_process.py", line 507 in execute\n'
        '  File "/site-packages/torch/nn/modules/module.py", line 1784 in _call_impl\n'
    )
    bare = {
        f"a bare {kind.__name__}": failure_text(kind())
        for kind in (
            AssertionError, Exception, RuntimeError, ValueError, TypeError, KeyError,
            IndexError, AttributeError, NotImplementedError, SystemExit, KeyboardInterrupt,
        )
    }  # fmt: skip
    return (
        ("the empty text", ""),
        *bare.items(),
        ("SystemExit: 0", failure_text(SystemExit(0))),
        ("SystemExit: 1", failure_text(SystemExit(1))),
        ("pytest's assertion of two values", "AssertionError: assert 0 == 1"),
        ("a wrong value", "AssertionError: value on rank 0: got 1, should be 2"),
        ("a traceback", f"Traceback (most recent call last):\n{stack}AssertionError"),
        (
            "a rank failure of a bare AssertionError",
            rank_failure(
                "threads", error_outcome(0, raised(AssertionError())), RankOutcome(1, "ok")
            ),
        ),
        (
            "a rank failure of SystemExit: 0",
            rank_failure(
                "processes",
                error_outcome(0, raised(SystemExit(0)), keep=False),
                RankOutcome(1, "waiting", summary="released: rank 0 failed"),
            ),
        ),
        (
            "a rank process that exited",
            rank_failure(
                "processes",
                RankOutcome(0, "crashed", summary="exited with code 1"),
                RankOutcome(1, "waiting", summary="waiting in a collective", traceback=stack),
            ),
        ),
        (
            "a rank failure at the deadline",
            rank_failure(
                "processes",
                RankOutcome(0, "timeout", summary="still running", traceback=stack),
                RankOutcome(1, "waiting", summary="waiting in a collective", traceback=stack),
                deadline=5.0,
            ),
        ),
    )


class ExpectationWarning(UserWarning):
    """An expectation that matched no test of the suites that ran."""


def marker_for(expectation: Expectation, torch: str) -> Any:
    """The pytest mark that applies ``expectation`` to a test on ``torch``."""
    import pytest

    why = (
        f"known deviation ({expectation.source}; {expectation.seen(torch)}): "
        f"{expectation.reason} [{expectation.link}]"
    )
    if expectation.status == "skip":
        return pytest.mark.skip(reason=why)
    raises = tuple(_exception_class(name, expectation.source) for name in expectation.raises)
    return pytest.mark.xfail(
        reason=why, strict=expectation.status == "xfail", raises=raises or None
    )


def _exception_class(name: str, source: str) -> type[BaseException]:
    import builtins

    from harness.runners.base import RankFailure

    known: dict[str, Any] = {"RankFailure": RankFailure}
    found = known.get(name, getattr(builtins, name, None))
    if not (isinstance(found, type) and issubclass(found, BaseException)):
        with raised_as(ExpectationError, source):
            fail("raises", name, "the name of a builtin exception or RankFailure")
    return found
