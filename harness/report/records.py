"""Read results files into typed, normalised records.

Results files are written by other processes and may be truncated, corrupt or from another
version of distconf: nothing here trusts a field's type. Every problem becomes a warning that
names the file (and the lines), never an exception, except a file that does not exist.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.errors import ReportError as ReportError  # re-exported: callers import it here
from harness.outcome.outputs import one_run_in, with_its_workers
from harness.outcome.results import STATUSES, Results, read_results
from harness.outcome.verdict import RunVerdict, is_unexpected, of_results, outcome
from harness.parity import Verdict


@dataclass(frozen=True)
class Metric:
    """One comparison of distributed against reference values (``parity``)."""

    name: str
    max_abs: float
    max_rel: float
    max_ulp: float | None
    rtol: float | None
    atol: float | None
    verdict: Verdict | None = None
    """What the criterion ``|a - b| <= atol + rtol * |b|`` gave, recorded with the
    comparison; None in a record written before comparisons carried it."""

    @property
    def within(self) -> bool:
        """The recorded verdict; for an old record, whether the error is inside the
        tolerance it was held to (abs or rel)."""
        if self.verdict is not None:
            return self.verdict.within
        if self.rtol is None and self.atol is None:
            return True
        return (self.atol is not None and self.max_abs <= self.atol) or (
            self.rtol is not None and self.max_rel <= self.rtol
        )


@dataclass(frozen=True)
class Expectation:
    """The known deviation a test ran under (``specs/expectations``)."""

    status: str
    reason: str
    link: str | None
    source: str | None
    verified: tuple[str, ...] = ()
    """The torch releases the deviation was seen on (none in records before they were kept)."""

    @property
    def href(self) -> str | None:
        """The link, only when it is a plain web address (never ``javascript:`` and co.)."""
        if self.link and self.link.startswith(("https://", "http://")):
            return self.link
        return None


@dataclass(frozen=True)
class Record:
    """One test record, its fields typed; ``source`` names the file it came from."""

    nodeid: str
    spec: str | None
    runner: str
    world_size: int | None
    device: str
    status: str
    unexpected: bool
    category: str | None
    """``harness.outcome.triage``'s category: new, different, fixed, unverified, known, or None."""
    duration: float | None
    examples: int | None
    falsifying_example: str | None
    error: str | None
    traceback: str | None
    primary_rank: int | None
    rank_statuses: tuple[tuple[int, str], ...]
    skip_reason: str | None
    metrics: tuple[Metric, ...]
    reproduce: str | None
    expectation: Expectation | None
    source: str
    exercised: tuple[tuple[str, int], ...] = ()
    """What the test's examples reached (``TestRecord.exercised``), label and count."""

    @property
    def column(self) -> tuple[str, int | None, str]:
        return (self.runner, self.world_size, self.device)


@dataclass(frozen=True)
class SourceFile:
    """One results file as read: its header and end records and what was wrong with it."""

    path: str
    header: Mapping[str, Any] | None
    end: Mapping[str, Any] | None
    tests: int
    bad_lines: tuple[int, ...]
    replaced_bytes: bool
    unfinished: tuple[str, ...] = ()
    """Tests that started and recorded no outcome: the session died running them."""
    schema_problem: str | None = None
    """No header, or a schema this distconf does not read: its records may mean otherwise."""
    noise: tuple[Mapping[str, Any], ...] = ()
    """torch's known noise kept off the run's console: its ``noise`` records."""


@dataclass(frozen=True)
class Loaded:
    """Every record of one run (one or more files), the warnings about its files and the
    run's verdict (``harness.outcome.verdict.of_results``, as the summary and JUnit give it)."""

    files: tuple[SourceFile, ...]
    records: tuple[Record, ...]
    warnings: tuple[str, ...]
    verdict: RunVerdict


def text(value: Any) -> str | None:
    """A field as text: strings as they are, other JSON values as JSON, null as None."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def _int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


def _float(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _metrics(value: Any) -> tuple[Metric, ...]:
    if not isinstance(value, Mapping):
        return ()
    metrics = []
    for name, fields in value.items():
        if not isinstance(fields, Mapping):
            continue
        max_abs, max_rel = _float(fields.get("max_abs")), _float(fields.get("max_rel"))
        if max_abs is None or max_rel is None:
            continue
        metrics.append(
            Metric(
                name=str(name),
                max_abs=max_abs,
                max_rel=max_rel,
                max_ulp=_float(fields.get("max_ulp")),
                rtol=_float(fields.get("rtol")),
                atol=_float(fields.get("atol")),
                verdict=Verdict.read(fields),
            )
        )
    return tuple(metrics)


def _rank_statuses(value: Any) -> tuple[tuple[int, str], ...]:
    if not isinstance(value, Mapping):
        return ()
    pairs = [(_int(rank), str(status)) for rank, status in value.items()]
    return tuple(sorted((rank, status) for rank, status in pairs if rank is not None))


def _expectation(value: Any) -> Expectation | None:
    if not isinstance(value, Mapping):
        return None
    return Expectation(
        status=text(value.get("status")) or "?",
        reason=text(value.get("reason")) or "",
        link=text(value.get("link")),
        source=text(value.get("source")),
        verified=tuple(str(v) for v in value.get("verified") or () if isinstance(v, str)),
    )


def normalise(raw: Mapping[str, Any], source: str) -> tuple[Record, str | None]:
    """The typed record, and a warning when its status is not one distconf writes."""
    status, category = outcome(raw)
    warning = None
    if raw.get("status") not in STATUSES:
        warning = (
            f"{source}: test {text(raw.get('nodeid'))!r} has status {text(raw.get('status'))!r},"
            f" which is not one of {', '.join(STATUSES)}; it is counted as an error"
        )
    record = Record(
        nodeid=text(raw.get("nodeid")) or "(no node id)",
        spec=text(raw.get("spec")),
        runner=text(raw.get("runner")) or "?",
        world_size=_int(raw.get("world_size")),
        device=text(raw.get("device")) or "?",
        status=status,
        unexpected=is_unexpected(raw),
        category=category,
        duration=_float(raw.get("duration")),
        examples=_int(raw.get("examples")),
        falsifying_example=text(raw.get("falsifying_example")),
        error=text(raw.get("error")),
        traceback=text(raw.get("traceback")),
        primary_rank=_int(raw.get("primary_rank")),
        rank_statuses=_rank_statuses(raw.get("rank_statuses")),
        skip_reason=text(raw.get("skip_reason")),
        metrics=_metrics(raw.get("metrics")),
        reproduce=text(raw.get("reproduce")),
        expectation=_expectation(raw.get("expectation")),
        source=source,
        exercised=_exercised(raw.get("exercised")),
    )
    return record, warning


def _exercised(value: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(value, Mapping):
        return ()
    return tuple(
        (str(label), count)
        for label, count in value.items()
        if isinstance(count, int) and not isinstance(count, bool)
    )


def expand(paths: Sequence[Path]) -> list[Path]:
    """The files named, a directory standing for its ``results*.jsonl`` and a run's main
    results file for itself and its workers' files beside it; missing → error."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            found = one_run_in(path, "RESULTS")
            if not found:
                raise ReportError(f"results directory {str(path)!r} holds no results*.jsonl")
            files += found
        elif path.is_file():
            files += with_its_workers(path)
        else:
            raise ReportError(f"results file {str(path)!r} does not exist")
    return list(dict.fromkeys(files))


def _read(path: Path) -> Results:
    try:
        return read_results(path)
    except OSError as exc:
        raise ReportError(f"results file {str(path)!r} cannot be read: {exc}") from None


def _file_warnings(source: SourceFile) -> list[str]:
    warnings = []
    if source.bad_lines:
        lines = ", ".join(map(str, source.bad_lines))
        warnings.append(
            f"{source.path}: line{'s' if len(source.bad_lines) > 1 else ''} {lines} "
            "could not be read (truncated or corrupt); the records on them are missing here"
        )
    if source.replaced_bytes:
        warnings.append(f"{source.path}: bytes that are not UTF-8 were replaced")
    if source.header is None:
        warnings.append(f"{source.path}: no header record; its versions and settings are unknown")
    elif source.schema_problem:
        warnings.append(f"{source.path}: {source.schema_problem}: its records may mean otherwise")
    if source.end is None:
        warnings.append(
            f"{source.path}: no end record: the run did not finish, results are partial"
        )
    if source.unfinished:
        warnings.append(
            f"{source.path}: started and recorded no outcome (the session died running it): "
            + ", ".join(source.unfinished)
        )
    refused = (source.end or {}).get("refused_connections")
    if refused:
        warnings.append(
            f"{source.path}: the torchrun driver refused {refused} connection"
            f"{'s' if refused != 1 else ''} (wrong token, no handshake or a bad hello; the "
            "run's output lists them)"
        )
    injected = (source.header or {}).get("faults")
    if injected:
        warnings.append(
            f"{source.path}: faults were injected ({', '.join(map(str, injected))}): a "
            "mutation run of torch deliberately broken, not a conformance verdict"
        )
    return warnings


def load(paths: Sequence[Path]) -> Loaded:
    """Every record of the files (or directories) in ``paths``, with warnings."""
    files, records, warnings, read = [], [], [], []
    for path in expand(paths):
        results = _read(path)
        read.append((str(path), results))
        source = SourceFile(
            path=str(path),
            header=results.header,
            end=results.end,
            tests=len(results.tests),
            bad_lines=tuple(results.bad_lines),
            replaced_bytes=results.replaced_bytes,
            unfinished=tuple(results.unfinished),
            schema_problem=results.schema_problem,
            noise=tuple(results.noise),
        )
        files.append(source)
        warnings += _file_warnings(source)
        for raw in results.tests:
            record, warning = normalise(raw, source.path)
            records.append(record)
            if warning:
                warnings.append(warning)
    if not records and not any(f.unfinished for f in files):
        raise _nothing_to_report(files)
    return Loaded(tuple(files), tuple(records), tuple(warnings), of_results(read))


def _nothing_to_report(files: Sequence[SourceFile]) -> ReportError:
    """Why files without a test record give no report: a run's main file whose workers'
    files are not beside it, or a run that ran nothing."""
    for source in files:
        workers = (source.end or {}).get("workers")
        if workers:
            return ReportError(
                f"no test records in {source.path}: it is the main results file of a run whose "
                f"{workers} xdist worker(s) recorded its tests in files of their own "
                "(results.gwN.jsonl, with the same run_id), and none of them lies beside it: "
                "name the workers' files too, or the directory holding them all"
            )
    names = ", ".join(f.path for f in files)
    return ReportError(f"no test records in {names}: nothing ran, so there is nothing to report")
