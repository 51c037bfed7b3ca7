"""The command line as a user meets it: a run's main results file reported with its
workers' files, help that speaks to users, and quiet when its reader leaves (``| head``)."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness import cli
from harness.config import available_suites
from harness.outcome.results import ResultsWriter, TestRecord, environment_stamp

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ("run", "list", "report", "expectations", "mutate", "bench", "reach", "surface")


def _run_of_two_workers(out: Path, run_id: str = "mine") -> Path:
    """The files an xdist run of two workers writes: the main file (the controller's, no
    test of its own) and a file per worker, each holding one test; the main file's path."""
    for worker in ("gw0", "gw1"):
        writer = ResultsWriter(
            out / f"results.{worker}.jsonl", environment_stamp(run_id=run_id, worker=worker)
        )
        nodeid = f"suites/test_uneven.py::test_{worker}[threads-ws1-cpu]"
        writer.write_start(nodeid)
        record = TestRecord(nodeid, "uneven.shard.torch_chunk", "threads", 1, "cpu", "passed", 1.0)
        writer.write_test(record)
        writer.close(exitstatus=0)
    main = ResultsWriter(out / "results.jsonl", environment_stamp(run_id=run_id, worker=None))
    main.close(exitstatus=0, workers=2)
    return out / "results.jsonl"


def test_report_of_a_runs_main_file_reads_its_workers_files_beside_it(tmp_path, capsys):
    """Row 1 of issue 38: the file README's run names is the main file of an xdist run."""
    out = tmp_path / "out"
    main = _run_of_two_workers(out)
    ResultsWriter(out / "results.gw7.jsonl", environment_stamp(run_id="theirs")).close()
    html = tmp_path / "r.html"
    assert cli.main(["report", str(main), "-o", str(html)]) == 0, capsys.readouterr().err
    page = html.read_text(encoding="utf-8")
    assert f"{out / 'results.gw0.jsonl'}<" in page and f"{out / 'results.gw1.jsonl'}<" in page
    assert "results.gw7.jsonl" not in page, "another run's file was read with this one"
    assert cli.main(["expectations", "check", str(main)]) == 0, capsys.readouterr().err


def test_a_main_file_without_its_workers_files_never_says_nothing_ran(tmp_path, capsys):
    main = _run_of_two_workers(tmp_path / "out")
    alone = tmp_path / "copied" / "results.jsonl"
    alone.parent.mkdir()
    shutil.copy(main, alone)
    assert cli.main(["report", str(alone), "-o", str(tmp_path / "r.html")]) == cli.USAGE_ERROR
    error = capsys.readouterr().err
    assert "nothing ran" not in error
    assert f"no test records in {alone}: it is the main results file of a run whose 2 " in error
    assert "name the workers' files too, or the directory holding them all" in error
    assert not (tmp_path / "r.html").exists()


def test_help_says_what_each_command_does_for_a_user_with_an_example(capsys):
    """Row 2: ``--help`` as git or pytest print theirs, not the module's docstring."""
    with pytest.raises(SystemExit) as ended:
        cli.main(["--help"])
    assert ended.value.code == 0
    text = capsys.readouterr().out
    for contributors_words in ("dispatch", "harness.session", "``", "render_report"):
        assert contributors_words not in text
    listed = text.split("commands:\n", 1)[1].split("\n\n", 1)[0]
    assert [line.split()[0] for line in listed.splitlines()] == list(COMMANDS)
    for name in COMMANDS:
        assert f"\n  python -m harness {name}" in text, f"no example of {name}"
    assert "'python -m harness COMMAND --help'" in text


@pytest.mark.parametrize("name", COMMANDS)
def test_each_commands_help_says_what_it_does_and_its_example_parses(name, capsys):
    with pytest.raises(SystemExit):
        cli.main([name, "--help"])
    text = capsys.readouterr().out
    assert text.startswith(f"usage: python -m harness {name} ")
    example = text.split("examples:\n", 1)[1].splitlines()[0].strip()
    words = shlex.split(example)
    assert words[:4] == ["python", "-m", "harness", name]
    assert cli._parser().parse_args(words[3:]).command == name


def _options(name: str) -> list[argparse.Action]:
    subparsers = next(
        a for a in cli._parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    parser = subparsers.choices[name]
    return [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_a_help_line_with_its_default_and_choices(name):
    """Row 3 (``run --help``; every other command's options too). ``run``'s options had
    help lines already but --suite, --seed and --junit; this pins them all."""
    for action in _options(name):
        spelled = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name} {spelled} has no help line"
        takes_a_value = action.option_strings and action.nargs != 0
        if takes_a_value:
            assert "default" in action.help, f"{name} {spelled} does not say its default"
        for choice in action.choices or ():
            assert str(choice) in action.help, f"{name} {spelled} does not name {choice}"


def test_run_names_every_suite_in_the_help_of_suite():
    (suite,) = [a for a in _options("run") if "--suite" in a.option_strings]
    assert suite.help is not None
    for name in available_suites():
        assert name in suite.help


def _with_its_reader_gone(*arguments: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``python -m harness ARGUMENTS`` writing to a pipe whose reader has already left, as
    ``| head`` leaves once it has its lines."""
    reading, writing = os.pipe()
    os.close(reading)
    try:
        return subprocess.run(
            [sys.executable, "-m", "harness", *arguments],
            stdout=writing, stderr=subprocess.PIPE, text=True, cwd=cwd, timeout=300,
            env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False,
        )  # fmt: skip
    finally:
        os.close(writing)


@pytest.mark.parametrize(
    "arguments",
    [
        ("list",),
        ("--help",),
        ("report", "{main}", "-o", "{tmp}/r.html"),
        ("expectations", "check", "{main}"),
    ],
    ids=["list", "help", "report", "expectations"],
)
def test_a_reader_that_left_ends_the_command_quietly(arguments, tmp_path):
    """Row 4: no BrokenPipeError traceback; the exit code a shell gives a tool SIGPIPE
    ended (``bench`` prints through the same ``main``). ``--help`` was quiet already: pinned."""
    main = _run_of_two_workers(tmp_path / "out")
    given = [a.format(main=main, tmp=tmp_path) for a in arguments]
    done = _with_its_reader_gone(*given, cwd=tmp_path)
    assert done.stderr == ""
    # argparse's --help swallows the failed write itself and exits 0: quiet all the same
    assert done.returncode == (0 if arguments == ("--help",) else cli.BROKEN_PIPE)
    assert cli.BROKEN_PIPE == 141
