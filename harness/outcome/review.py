"""``python -m harness expectations``: what a run says about each known deviation, and the
record of a person's review of it.

``check RESULTS...`` lists every expectation of ``specs/expectations`` with what the run
says about it (``harness.outcome.triage``), read against the files as they are now (so a reviewed
run reads as known), then the run's failures no expectation covers.
``update RESULTS... --verified`` adds the run's torch release to ``verified`` of each
expectation whose deviation the run saw and did not see otherwise (``unverified`` tests
only, no ``different`` or ``fixed`` one); ``--fixed`` closes the ``torch`` range below the
run's release for each expectation whose every test passed. Files are edited line by line,
so their comments and layout stay; every change is checked (the edited file must load and
say what was meant) before any file is written, and the files are written all or none
(``write_together``: a full disk leaves every file as it was).
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
import tomllib
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from harness.errors import ExpectationError, ReportError
from harness.outcome import expectations, triage
from harness.outcome.outputs import one_run_in, with_its_workers
from harness.outcome.results import Results, read_results

_HEADER = "[[expect]]"


@dataclass(frozen=True)
class Run:
    """The test records of one run and the torch release it ran."""

    torch: str
    records: tuple[dict[str, Any], ...]

    def under(self, entry: expectations.Expectation) -> list[dict[str, Any]]:
        return [
            r for r in self.records if (r.get("expectation") or {}).get("source") == entry.source
        ]


def read_run(paths: Sequence[Path]) -> Run:
    """The records of ``paths`` (files, or directories of ``results*.jsonl``; a run's main
    file brings its workers' files beside it); one torch."""
    files: list[Path] = []
    for path in paths:
        found = one_run_in(path, "RESULTS") if path.is_dir() else with_its_workers(path)
        if not found or not all(f.is_file() for f in found):
            raise ReportError(
                f"RESULTS={str(path)!r} must be a results file or a directory of them"
            )
        files += found
    files = list(dict.fromkeys(files))  # a worker's file named beside its run's main file
    read: list[Results] = [read_results(f) for f in files]
    pairs = zip(files, read, strict=True)
    misread = [f"{str(f)!r}: {r.schema_problem}" for f, r in pairs if r.schema_problem]
    if misread:
        raise ReportError(
            f"RESULTS={[str(p) for p in paths]!r} must be results this distconf reads: "
            + "; ".join(misread)
        )
    versions = triage.releases(r.header for r in read)
    if len(versions) != 1:
        raise ReportError(
            f"RESULTS={[str(p) for p in paths]!r} must be the results of one torch release; "
            f"their headers name {sorted(versions) or 'none'}"
        )
    return Run(versions[0], tuple(record for r in read for record in r.tests))


def reviewed(entry: expectations.Expectation, record: dict[str, Any], torch: str) -> str:
    """A record's category as the expectation now reads (a review may have followed the
    run): held on a torch since verified is known; a fix the range now ends before is done."""
    found = triage.category(record) or str(record.get("status"))
    if found == "unverified" and entry.verified_on(torch):
        return "known"
    if found == "fixed" and entry.torch is not None and Version(torch) not in entry.torch:
        return f"fixed (torch {entry.torch})"
    return found


def status_line(entry: expectations.Expectation, run: Run) -> str:
    """What the run says about one expectation, as the expectation now reads."""
    records = run.under(entry)
    if records:
        tally = Counter(reviewed(entry, r, run.torch) for r in records)
        said = ", ".join(f"{n} {what}" for what, n in sorted(tally.items()))
        return f"{said} [{entry.seen(run.torch)}]"
    if entry.torch is not None and Version(run.torch) not in entry.torch:
        return f"does not apply to torch {run.torch} (torch {entry.torch})"
    if not any(r.get("spec") == entry.spec for r in run.records):
        return "its spec did not run"
    return "its spec ran, but not under this expectation's runner/device/world size"


def check(paths: Sequence[Path], directory: Path) -> int:
    """Print what the run says about each expectation, then its new failures; 0, or 1 when a
    person must act (a new or different failure, a fixed or unverified deviation)."""
    run = read_run(paths)
    entries = expectations.load(directory)
    print(f"torch {run.torch}: {len(entries)} expectations in {directory}")
    for entry in entries:
        print(f"  {entry.source:<22} {entry.spec:<50} {status_line(entry, run)}")
    new = [f for f in triage.findings(map(triage.seen, run.records)) if f.category == "new"]
    if new:
        print(f"failures no expectation covers ({len(new)} spec(s)):")
        print("\n".join(f"  {triage.describe(f, run.torch)}" for f in new))
    by_source = {e.source: e for e in entries}

    def now(record: dict[str, Any]) -> str | None:
        entry = by_source.get(str((record.get("expectation") or {}).get("source")))
        return triage.category(record) if entry is None else reviewed(entry, record, run.torch)

    return int(any(now(r) in triage.TO_REVIEW for r in run.records))


@dataclass(frozen=True)
class Edit:
    path: Path
    index: int
    """0-based position of the entry in its file."""
    field: str
    value: Any
    why: str


def plan(
    run: Run, entries: Sequence[expectations.Expectation], *, verified: bool, fixed: bool
) -> tuple[list[Edit], list[str]]:
    """The edits the run justifies, and why each other expectation it touched is left."""
    edits: list[Edit] = []
    left: list[str] = []
    for entry in entries:
        found = Counter(triage.category(r) for r in run.under(entry))
        if not found:
            continue
        path, index = _located(entry)
        if verified and found["unverified"] and set(found) <= {"unverified", "known", None}:
            seen = [*entry.verified, run.torch]
            edits.append(Edit(path, index, "verified", seen, f"seen on {run.torch}"))
        elif fixed and set(found) == {"fixed"}:
            edits.append(
                Edit(path, index, "torch", _closed(entry, run.torch), f"fixed in {run.torch}")
            )
        elif found["different"] or found["fixed"] or found["unverified"]:
            said = ", ".join(f"{n} {c}" for c, n in found.items() if c)
            left.append(f"{entry.source} ({entry.spec}): {said}: left for a person to edit")
    return edits, left


def _located(entry: expectations.Expectation) -> tuple[Path, int]:
    name, _, number = entry.source.rpartition(" #")
    return Path(name), int(number) - 1


def _closed(entry: expectations.Expectation, release: str) -> str:
    kept = [s for s in (entry.torch or SpecifierSet()) if s.operator not in ("<", "<=", "==")]
    return ",".join(sorted([*map(str, kept), f"<{release}"]))


def update(
    paths: Sequence[Path], directory: Path, *, verified: bool, fixed: bool, dry_run: bool
) -> int:
    """Apply ``plan``'s edits to the files in ``directory``; every file is checked first."""
    if not (verified or fixed):
        raise ExpectationError(
            "update needs --verified, --fixed or both: what did the review find?"
        )
    run = read_run(paths)
    entries = expectations.load(directory)
    edits, left = plan(run, entries, verified=verified, fixed=fixed)
    texts = _edited(directory, edits)
    for edit in edits:
        value = toml_value(edit.value)
        print(f"{edit.path} #{edit.index + 1}: {edit.field} = {value}  ({edit.why})")
    for line in left:
        print(line)
    if not edits:
        print("nothing to update")
    elif dry_run:
        print("(dry run: no file written)")
    else:
        write_together(directory, texts)
    return 0


def write_together(directory: Path, texts: dict[str, str]) -> None:
    """Write every file of ``texts`` or none: each goes to a temporary file beside it first
    (where a full disk fails), and only when all are written are they renamed over the files
    (a rename in one directory needs no space); a failure removes the temporaries."""
    written: dict[Path, Path] = {}
    try:
        for name, text in texts.items():
            written[directory / name] = _temporary_beside(directory / name, text)
    except OSError as exc:
        _remove(written.values())
        raise ExpectationError(
            f"writing {name} in {directory} failed ({exc}): no expectation file was changed"
        ) from None
    replaced: list[str] = []
    try:
        for target, temporary in written.items():
            os.replace(temporary, target)
            replaced.append(target.name)
    except OSError as exc:
        _remove(written.values())
        raise ExpectationError(
            f"renaming the new {target.name} over the old in {directory} failed ({exc}): "
            f"{replaced or 'no file'} written, the others left as they were"
        ) from None


def _temporary_beside(target: Path, text: str) -> Path:
    """``text`` in a new file beside ``target`` with its permissions, on disk."""
    handle, made = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(made, stat.S_IMODE(target.stat().st_mode))
    except OSError:
        Path(made).unlink(missing_ok=True)
        raise
    return Path(made)


def _remove(paths: Iterable[Path]) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _edited(directory: Path, edits: Sequence[Edit]) -> dict[str, str]:
    grouped: dict[str, list[Edit]] = defaultdict(list)
    for edit in edits:
        grouped[str(edit.path)].append(edit)
    texts = {}
    for name, file_edits in grouped.items():
        text = (directory / name).read_text(encoding="utf-8")
        for edit in file_edits:
            text = set_field(text, edit.index, edit.field, edit.value)
        texts[name] = text
    _check(directory, texts)
    return texts


def set_field(text: str, index: int, field: str, value: Any) -> str:
    """``text`` with ``field = value`` in its ``index``-th ``[[expect]]`` entry (the line
    replaced where the field is, else added after the entry's ``torch`` or ``link`` line)."""
    lines = text.splitlines(keepends=True)
    heads = [i for i, line in enumerate(lines) if line.strip() == _HEADER]
    if not 0 <= index < len(heads):
        raise ExpectationError(f"entry #{index + 1} is not in the file ({len(heads)} entries)")
    start, end = heads[index], (heads[index + 1] if index + 1 < len(heads) else len(lines))
    line = f"{field} = {toml_value(value)}\n"
    at = _line_of(lines, start, end, field)
    if at is not None:
        lines[at] = line
        return "".join(lines)
    after = _line_of(lines, start, end, "torch") or _line_of(lines, start, end, "link") or start
    lines.insert(after + 1, line)
    return "".join(lines)


def toml_value(value: Any) -> str:
    """``value`` as TOML: a string with backslashes (a regular expression) as a literal
    string where it can be, so that it reads as written; else as JSON, which TOML reads alike."""
    if isinstance(value, str) and "\\" in value and not set(value) & {"'", "\n", "\r"}:
        return f"'{value}'"
    return json.dumps(value)


def _line_of(lines: list[str], start: int, end: int, field: str) -> int | None:
    pattern = re.compile(rf"^\s*{re.escape(field)}\s*=")
    found = [i for i in range(start, end) if pattern.match(lines[i])]
    if found and not _one_line(lines[found[0]]):
        raise ExpectationError(f"{field} of the entry spans several lines: edit it by hand")
    return found[0] if found else None


def _one_line(line: str) -> bool:
    try:
        tomllib.loads(line)
    except tomllib.TOMLDecodeError:
        return False
    return True


def _check(directory: Path, texts: dict[str, str]) -> None:
    """The files as edited load as expectations (each value valid): checked in a copy."""
    with tempfile.TemporaryDirectory() as scratch:
        for path in directory.glob("*.toml"):
            text = texts.get(path.name, path.read_text(encoding="utf-8"))
            (Path(scratch) / path.name).write_text(text, encoding="utf-8")
        try:
            expectations.load(Path(scratch))
        except ExpectationError as exc:
            raise ExpectationError(f"the edits would break the file, none written: {exc}") from None
