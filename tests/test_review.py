"""``harness expectations check | update``: what a run says about each known deviation, and
recording a review in the expectation files, comments and layout kept."""

from __future__ import annotations

import errno
import io
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest

from harness import cli
from harness.outcome import expectations, review
from harness.outcome.results import ResultsWriter, TestRecord, environment_stamp

KNOWN = """# Known deviations (a comment that must survive an update).

[[expect]]
spec = "demo.still"
status = "xfail"
reason = "torch sums twice"
link = "https://example.invalid/1"
torch = ">=2.13"
fingerprint = "sums twice"
verified = ["2.13.0"]

[[expect]]
spec = "demo.fixed"
status = "xfail"
reason = "torch drops a shard"
link = "https://example.invalid/2"
torch = ">=2.13"
fingerprint = "drops"
verified = ["2.13.0"]

[[expect]]
spec = "demo.changed"
status = "xfail"
reason = "torch sums twice here too"
link = "https://example.invalid/3"
fingerprint = "sums twice"
verified = ["2.13.0"]

[[expect]]
spec = "demo.old"
status = "xfail"
reason = "gone long ago"
link = "https://example.invalid/4"
torch = "<2.10"
fingerprint = "gone"
verified = ["2.9.0"]
"""


def _expectation(source: str, verified_here: bool = False) -> dict[str, object]:
    return {
        "status": "xfail",
        "reason": "r",
        "link": "https://example.invalid",
        "source": source,
        "verified": ["2.13.0"],
        "verified_here": verified_here,
    }


def _run(tmp_path, torch="2.15.0+cpu"):
    out = tmp_path / "run"
    writer = ResultsWriter(out / "results.jsonl", {**environment_stamp(), "torch": torch})
    tests = [
        ("demo.still", "xfailed", _expectation("known.toml #1")),
        ("demo.still", "xfailed", _expectation("known.toml #1")),
        ("demo.fixed", "xpassed", _expectation("known.toml #2")),
        ("demo.changed", "failed", _expectation("known.toml #3")),
        ("demo.new", "failed", None),
        ("demo.fine", "passed", None),
    ]
    for number, (spec, status, expected) in enumerate(tests):
        writer.write_test(
            TestRecord(
                nodeid=f"t.py::test_{number}",
                spec=spec,
                runner="threads",
                world_size=2,
                device="cpu",
                status=status,
                duration=0.1,
                expectation=expected,
            )
        )
    writer.close(exitstatus=1)
    return out


@pytest.fixture
def known(tmp_path):
    directory = tmp_path / "expectations"
    directory.mkdir()
    (directory / "known.toml").write_text(KNOWN)
    return directory


def test_check_says_what_the_run_says_of_each_expectation(tmp_path, known, capsys):
    code = review.check([_run(tmp_path)], known)
    printed = capsys.readouterr().out
    assert code == 1
    assert "torch 2.15.0: 4 expectations" in printed
    assert "known.toml #1" in printed and "2 unverified [verified on 2.13.0, not 2.15.0]" in printed
    assert "1 fixed" in printed and "1 different" in printed
    assert "does not apply to torch 2.15.0 (torch <2.10)" in printed
    assert "demo.new: fails: no known deviation [1 test(s)]" in printed


def test_update_verified_adds_the_release_and_keeps_the_file(tmp_path, known, capsys):
    before = (known / "known.toml").read_text()
    assert review.update([_run(tmp_path)], known, verified=True, fixed=False, dry_run=False) == 0
    after = (known / "known.toml").read_text()
    data = tomllib.loads(after)["expect"]
    assert data[0]["verified"] == ["2.13.0", "2.15.0"]  # seen as known: verified
    assert data[1]["verified"] == ["2.13.0"]  # fixed: not verified
    assert data[2]["verified"] == ["2.13.0"]  # a different failure: for a person
    assert after.startswith("# Known deviations (a comment that must survive an update).")
    assert len(after.splitlines()) == len(before.splitlines())
    printed = capsys.readouterr().out
    assert "known.toml #3 (demo.changed): 1 different: left for a person to edit" in printed
    assert expectations.load(known)[0].verified_on("2.15.0")


def test_update_fixed_closes_the_range_below_the_release(tmp_path, known):
    review.update([_run(tmp_path)], known, verified=False, fixed=True, dry_run=False)
    data = tomllib.loads((known / "known.toml").read_text())["expect"]
    assert data[1]["torch"] == "<2.15.0,>=2.13"
    assert data[0]["torch"] == ">=2.13"
    (entry,) = [e for e in expectations.load(known) if e.spec == "demo.fixed"]
    assert not entry.matches(
        spec="demo.fixed", runner="t", device="c", backend="b", world_size=2, torch="2.15.0"
    )


def test_a_dry_run_writes_nothing(tmp_path, known, capsys):
    before = (known / "known.toml").read_text()
    review.update([_run(tmp_path)], known, verified=True, fixed=True, dry_run=True)
    assert (known / "known.toml").read_text() == before
    assert "(dry run: no file written)" in capsys.readouterr().out


def test_an_update_that_would_break_a_file_writes_nothing(tmp_path, known):
    # A verified value spread over lines cannot be edited line by line: refused, untouched.
    text = KNOWN.replace('verified = ["2.13.0"]', 'verified = [\n  "2.13.0",\n]', 1)
    (known / "known.toml").write_text(text)
    with pytest.raises(expectations.ExpectationError, match="spans several lines"):
        review.update([_run(tmp_path)], known, verified=True, fixed=False, dry_run=False)
    assert (known / "known.toml").read_text() == text


def test_set_field_inserts_after_torch_or_link(tmp_path):
    text = (
        '[[expect]]\nspec = "a"\nlink = "l"\n\n'
        '[[expect]]\nspec = "b"\ntorch = ">=1"\nreason = "r"\n'
    )
    edited = review.set_field(text, 1, "verified", ["1.0"])
    assert edited.splitlines()[6:8] == ['torch = ">=1"', 'verified = ["1.0"]']
    edited = review.set_field(text, 0, "verified", ["1.0"])
    assert edited.splitlines()[2:4] == ['link = "l"', 'verified = ["1.0"]']
    with pytest.raises(expectations.ExpectationError, match="entry #3 is not in the file"):
        review.set_field(text, 2, "verified", [])


def test_the_command_refuses_bad_input_before_touching_anything(tmp_path, known, capsys):
    assert (
        cli.main(
            [
                "expectations",
                "update",
                str(tmp_path / "nowhere"),
                "--verified",
                "--expectations",
                str(known),
            ]
        )
        == cli.USAGE_ERROR
    )
    assert "must be a results file or a directory of them" in capsys.readouterr().err
    run = _run(tmp_path)
    assert cli.main(["expectations", "update", str(run), "--expectations", str(known)]) == 4
    assert "update needs --verified, --fixed or both" in capsys.readouterr().err
    other = _run(tmp_path / "other", torch="2.13.0")
    code = cli.main(["expectations", "check", str(run), str(other), "--expectations", str(known)])
    assert code == cli.USAGE_ERROR
    assert "must be the results of one torch release" in capsys.readouterr().err


def test_check_refuses_a_catch_all_expectation(tmp_path, known, capsys):
    (known / "probe.toml").write_text(
        '[[expect]]\nspec = "demo.new"\nstatus = "flaky"\nreason = "any failure"\n'
        'link = "none"\nfingerprint = "(?:)"\nverified = ["2.15.0"]\n'
    )
    code = cli.main(["expectations", "check", str(_run(tmp_path)), "--expectations", str(known)])
    assert code == cli.USAGE_ERROR
    err = capsys.readouterr().err
    assert "error: probe.toml #1: fingerprint='(?:)' must be a regular expression found in" in err


def _seen_in_two_files(tmp_path):
    """Expectations in two files, and a run that saw both deviations on a torch neither was
    verified on: ``update --verified`` edits both files."""
    directory = tmp_path / "expectations"
    directory.mkdir()
    for name in ("first", "second"):
        entry = KNOWN.split("[[expect]]")[1].replace("demo.still", f"demo.{name}")
        (directory / f"{name}.toml").write_text(f"# {name}\n[[expect]]{entry}")
    out = tmp_path / "run"
    writer = ResultsWriter(out / "results.jsonl", {**environment_stamp(), "torch": "2.15.0"})
    for number, name in enumerate(("first", "second")):
        writer.write_test(
            TestRecord(
                nodeid=f"t.py::test_{number}", spec=f"demo.{name}", runner="threads",
                world_size=2, device="cpu", status="xfailed", duration=0.1,
                expectation=_expectation(f"{name}.toml #1"),
            )
        )  # fmt: skip
    writer.close(exitstatus=0)
    return directory, out


class _DiskFull:
    """A text file on a disk that fills up: half of the first write lands, then ENOSPC."""

    def __init__(self, file: Any) -> None:
        self.file = file

    def write(self, text: str) -> int:
        self.file.write(text[: len(text) // 2])
        self.file.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self) -> _DiskFull:
        return self

    def __exit__(self, *exc: object) -> None:
        self.file.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.file, name)


def _fill_the_disk_after_one_file(monkeypatch, directory):
    """Every file opened for writing in ``directory`` after the first is on a full disk
    (``io.open`` is what ``Path.write_text`` and ``os.fdopen`` open files with)."""
    real_open = io.open
    opened: list[object] = []

    def in_directory(file: object) -> bool:
        if isinstance(file, int):
            inode = os.fstat(file).st_ino
            return any(p.stat().st_ino == inode for p in directory.iterdir())
        return Path(str(file)).resolve().parent == directory.resolve()

    def open_(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        handle = real_open(file, mode, *args, **kwargs)
        if not set(mode) & set("wax+") or not in_directory(file):
            return handle
        opened.append(file)
        return handle if len(opened) == 1 else _DiskFull(handle)

    monkeypatch.setattr(io, "open", open_)
    return opened


def test_an_update_that_runs_out_of_disk_changes_no_file(tmp_path, monkeypatch, capsys):
    directory, run = _seen_in_two_files(tmp_path)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    opened = _fill_the_disk_after_one_file(monkeypatch, directory)
    command = ["expectations", "update", str(run), "--verified", "--expectations", str(directory)]
    code = cli.main(command)
    monkeypatch.undo()
    assert len(opened) == 2, "the update did not write both files"
    assert code != 0
    err = capsys.readouterr().err
    assert "No space left on device" in err and "no expectation file was changed" in err
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # no temporary left
    # With room on the disk, the same update writes both files.
    assert cli.main(command) == 0
    assert [e.verified for e in expectations.load(directory)] == [("2.13.0", "2.15.0")] * 2
