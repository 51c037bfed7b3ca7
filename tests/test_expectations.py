"""Known deviations: loading, matching, and how they mark tests and records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from harness.outcome import expectations

TORCH = metadata.version("torch")
ROOT = Path(__file__).resolve().parent.parent

ENTRY = """
[[expect]]
spec = "demo.sum"
status = "{status}"
reason = "torch sums twice"
link = "https://example.invalid/issue/1"
torch = ">=2.13,<2.14"
fingerprint = "sums twice"
verified = ["2.13.0"]
{extra}
"""


def _write(tmp_path, text):
    (tmp_path / "e.toml").write_text(textwrap.dedent(text))
    return expectations.load(tmp_path)


TEST = dict(spec="demo.sum", runner="threads", device="cpu", backend="threaded", world_size=2)
"""One test's spec and World, as expectations are matched against them."""


def test_matching_honours_every_condition(tmp_path):
    (entry,) = _write(
        tmp_path,
        ENTRY.format(
            status="xfail", extra='runner = ["threads"]\nbackend = ["threaded"]\nworld_size = [2]'
        ),
    )
    match = {**TEST, "torch": "2.13.0+cpu"}
    assert entry.matches(**match)
    assert not entry.matches(**{**match, "backend": "my_vendor_backend"})
    assert not entry.matches(**{**match, "torch": "2.14.0"})
    assert not entry.matches(**{**match, "runner": "processes"})
    assert not entry.matches(**{**match, "world_size": 4})
    assert not entry.matches(**{**match, "spec": "demo.other"})
    assert entry.as_record("2.13.0+cpu")["verified_here"]
    assert not entry.as_record("2.15.0")["verified_here"]
    assert entry.as_record("2.13.0")["conditions"] == {
        "torch": "<2.14,>=2.13",
        "runner": ["threads"],
        "backend": ["threaded"],
        "world_size": [2],
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ENTRY.format(status="maybe", extra=""), "status='maybe' must be one of"),
        (ENTRY.format(status="xfail", extra='torch_ver = "1"'), "unknown fields \\['torch_ver'\\]"),
        (
            ENTRY.format(status="xfail", extra="").replace(
                'link = "https://example.invalid/issue/1"', ""
            ),
            "needs non-empty string fields \\['link'\\]",
        ),
        (
            ENTRY.format(status="xfail", extra="").replace(">=2.13,<2.14", "two point thirteen"),
            "torch='two point thirteen' must be a version range",
        ),
        (
            ENTRY.format(status="xfail", extra="world_size = [0]"),
            "world_size=\\[0\\] must be a list of positive",
        ),
        ("[[expect", "not valid TOML"),
        (
            ENTRY.format(status="xfail", extra="").replace('fingerprint = "sums twice"', ""),
            "fingerprint=None must be a regular expression found in the known failure's text",
        ),
        (
            ENTRY.format(status="xfail", extra="").replace('"sums twice"', '"sums (twice"'),
            "fingerprint='sums \\(twice' must be a valid regular expression",
        ),
        (
            ENTRY.format(status="xfail", extra="").replace('verified = ["2.13.0"]', ""),
            "verified=None must be a non-empty list of the torch releases",
        ),
        (
            ENTRY.format(status="xfail", extra="").replace('["2.13.0"]', '["thirteen"]'),
            "'thirteen' is not a version",
        ),
    ],
)
def test_malformed_entries_name_file_entry_and_field(tmp_path, text, message):
    with pytest.raises(expectations.ExpectationError, match=message):
        _write(tmp_path, text)


CATCH_ALL = [
    "(?:)", ".*", ".", r"\w", r"[\s\S]*", "^", "x*", r"\b", "(?=A)", "Error", "Exception",
    "AssertionError", "SystemExit", "Traceback", "rank", "failed", r"rank \d+ of \d+",
    r"deadline of [\d.]+ s.* expired", "got .*, should be", "with no message, raised at",
]  # fmt: skip
"""Fingerprints any failure could hold: the empty text, a bare exception, a rank's exit, a
rank failure's header, a hang, a wrong value."""


@pytest.mark.parametrize("fingerprint", CATCH_ALL)
def test_a_fingerprint_any_failure_could_hold_is_refused(tmp_path, fingerprint):
    text = ENTRY.format(status="xfail", extra="").replace('"sums twice"', f"'{fingerprint}'")
    with pytest.raises(expectations.ExpectationError) as refused:
        _write(tmp_path, text)
    assert str(refused.value).startswith(
        f"e.toml #1: fingerprint={fingerprint!r} must be a regular expression found in the "
        "known failure's text and not in any failure's: it matches "
    )


def test_a_catch_all_flaky_entry_without_a_link_is_refused(tmp_path):
    """The probe of issue 32: a flaky entry that any failure of its spec would satisfy."""
    probe = (
        '[[expect]]\nspec = "demo.sum"\nstatus = "flaky"\nreason = "r"\nlink = "none"\n'
        'fingerprint = "(?:)"\nverified = ["2.13.0"]\n'
    )
    with pytest.raises(expectations.ExpectationError, match=r"e\.toml #1: fingerprint='\(\?:\)'"):
        _write(tmp_path, probe)
    probe = probe.replace('"(?:)"', '"sums twice"')
    with pytest.raises(expectations.ExpectationError, match=r"e\.toml #1: link='none' must be an"):
        _write(tmp_path, probe)
    probe = probe.replace('"none"', '"https://example.invalid/1"')
    with pytest.raises(expectations.ExpectationError, match=r"e\.toml #1: flaky_because=None must"):
        _write(tmp_path, probe)
    (entry,) = _write(tmp_path, probe + 'flaky_because = "only large meshes meet it"\n')
    assert entry.as_record(TORCH)["flaky_because"] == "only large meshes meet it"


@pytest.mark.parametrize(
    "link", ["none", "ftp://example.invalid/1", "https://", "example.invalid/1", "https://a b"]
)
def test_a_link_must_be_an_http_url(tmp_path, link):
    text = ENTRY.format(status="xfail", extra="").replace("https://example.invalid/issue/1", link)
    with pytest.raises(expectations.ExpectationError, match=f"link={link!r} must be an http"):
        _write(tmp_path, text)


def test_only_a_flaky_entry_says_why_it_is_flaky(tmp_path):
    text = ENTRY.format(status="xfail", extra='flaky_because = "some draws"')
    with pytest.raises(expectations.ExpectationError, match="flaky_because='some draws' must be"):
        _write(tmp_path, text)
    (tmp_path / "e.toml").unlink()
    with pytest.raises(expectations.ExpectationError, match="flaky_because='  ' must be a non-em"):
        _write(tmp_path, ENTRY.format(status="flaky", extra='flaky_because = "  "'))


def _bare_assertion_in(filename: str) -> BaseException:
    """A rank failure of a bare AssertionError raised in ``_shard_tensor`` of ``filename``, as
    the thread runner raises it (the rank's exception kept as the cause)."""
    from harness.runners.base import error_outcome, settle

    namespace: dict[str, object] = {}
    source = "def _shard_tensor():\n    raise AssertionError\n"
    exec(compile(source, filename, "exec"), namespace)
    try:
        namespace["_shard_tensor"]()  # type: ignore[operator]
    except AssertionError as exc:
        outcomes = [error_outcome(0, exc), error_outcome(1, exc)]
    try:
        settle(outcomes, runner="threads", device="cpu")
    except BaseException as failure:
        return failure
    raise AssertionError("settle raised nothing")


def test_a_bare_assertion_is_told_by_where_it_was_raised():
    (entry,) = [e for e in expectations.load() if e.spec == "state_dict.full.uneven_strided"]
    torch = "/site-packages/torch/distributed/tensor/placement_types.py"
    in_torch = expectations.failure_text(_bare_assertion_in(torch))
    assert f'AssertionError with no message, raised at:\n  File "{torch}", line 2,' in in_torch
    assert entry.recognises(in_torch)
    elsewhere = expectations.failure_text(_bare_assertion_in("/suites/checks/state_dict.py"))
    assert not entry.recognises(elsewhere)


def test_a_skip_needs_no_fingerprint_and_a_fingerprint_pins_the_failure(tmp_path):
    (entry,) = _write(
        tmp_path, ENTRY.format(status="skip", extra="").replace('fingerprint = "sums twice"', "")
    )
    assert entry.fingerprint is None
    (tmp_path / "e.toml").unlink()
    (entry,) = _write(tmp_path, ENTRY.format(status="xfail", extra=""))
    assert entry.recognises(expectations.failure_text(AssertionError("torch sums twice")))
    assert not entry.recognises(expectations.failure_text(AssertionError("off by one")))
    group = ExceptionGroup("two", [KeyError("k"), AssertionError("torch sums twice")])
    assert expectations.failure_text(group) == "KeyError: 'k'\nAssertionError: torch sums twice"


def test_verification_ignores_the_local_build_tag(tmp_path):
    (entry,) = _write(tmp_path, ENTRY.format(status="xfail", extra=""))
    assert entry.verified_on("2.13.0+cpu") and not entry.verified_on("2.13.1")
    assert entry.seen("2.15.0") == "verified on 2.13.0, not 2.15.0"


def test_two_entries_for_one_test_is_an_error(tmp_path):
    entries = _write(tmp_path, ENTRY.format(status="xfail", extra="") * 2)
    with pytest.raises(expectations.ExpectationError, match=r"e\.toml #1, e\.toml #2 all match"):
        expectations.find(entries, **TEST, torch="2.13.0")


def test_the_shipped_expectations_load_and_name_catalogue_specs():
    from harness import catalogue

    specs = catalogue.load()
    entries = expectations.load()
    assert entries
    assert all(e.spec in specs and e.link.startswith("https://") for e in entries)


CATALOGUE = """
[[spec]]
id = "demo.{name}"
area = "demo"
suite = "demo"
statement = "s"
provenance = "p"
status = "active"
"""

SUITE = """
import pytest

def _sums(ctx):
    return 1

@pytest.mark.spec("demo.fails")
def test_fails(world):
    assert world.run(_sums) == [2] * world.world_size, "torch sums twice"

@pytest.mark.spec("demo.passes")
def test_passes(world):
    assert world.run(_sums) == [1] * world.world_size

@pytest.mark.spec("demo.flaky")
def test_flaky(world):
    pass

@pytest.mark.spec("demo.hangs")
def test_hangs(world):
    raise AssertionError("must not run")

@pytest.mark.spec("demo.wrong")
def test_wrong_failure(world):
    raise KeyError("a harness bug, not the deviation")

@pytest.mark.spec("demo.other")
def test_other_failure(world):
    assert world.run(_sums) == [3] * world.world_size, "torch sums thrice"

@pytest.mark.spec("demo.unverified")
def test_unverified(world):
    assert world.run(_sums) == [2] * world.world_size, "torch sums twice"
"""

EXPECTATIONS = """
[[expect]]
spec = "demo.fails"
status = "xfail"
reason = "torch sums twice"
link = "https://example.invalid/1"
fingerprint = "sums twice"
verified = ["{torch}"]

[[expect]]
spec = "demo.passes"
status = "xfail"
reason = "was broken in an older torch"
link = "https://example.invalid/2"
fingerprint = "sums twice"
verified = ["{torch}"]

[[expect]]
spec = "demo.flaky"
status = "flaky"
reason = "sometimes"
flaky_because = "only some examples meet it"
link = "https://example.invalid/3"
fingerprint = "sums twice"
verified = ["{torch}"]

[[expect]]
spec = "demo.hangs"
status = "skip"
reason = "hangs in all_to_all"
link = "https://example.invalid/4"
verified = ["{torch}"]

[[expect]]
spec = "demo.wrong"
status = "xfail"
reason = "shows as an AssertionError"
link = "https://example.invalid/5"
raises = ["AssertionError"]
fingerprint = "a harness bug"
verified = ["{torch}"]

[[expect]]
spec = "demo.fails"
status = "xfail"
reason = "only on a runner that does not run here"
link = "https://example.invalid/6"
runner = ["processes"]
fingerprint = "sums twice"
verified = ["{torch}"]

[[expect]]
spec = "demo.other"
status = "xfail"
reason = "torch sums twice (a second bug makes it sum thrice)"
link = "https://example.invalid/7"
fingerprint = "sums twice"
verified = ["{torch}"]

[[expect]]
spec = "demo.unverified"
status = "xfail"
reason = "torch sums twice, seen on an older release only"
link = "https://example.invalid/8"
fingerprint = "sums twice"
verified = ["2.12.0"]
"""


@pytest.fixture
def project(pytester):
    names = ("fails", "passes", "flaky", "hangs", "wrong", "other", "unverified")
    pytester.makeini(
        "[pytest]\ndistconf_catalogue = catalogue.toml\ndistconf_suites = conformance\n"
        "distconf_expectations = expectations\n"
    )
    (pytester.path / "catalogue.toml").write_text("".join(CATALOGUE.format(name=n) for n in names))
    (pytester.path / "conformance").mkdir()
    (pytester.path / "conformance" / "test_demo.py").write_text(SUITE)
    (pytester.path / "expectations").mkdir()
    (pytester.path / "expectations" / "known.toml").write_text(
        EXPECTATIONS.replace("{torch}", TORCH)
    )
    return pytester


def test_expectations_mark_tests_and_travel_into_records(project):
    results = project.path / "r.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=2", f"--distconf-results={results}", "-rsxX"
    )
    run.assert_outcomes(xfailed=2, failed=3, skipped=1, xpassed=1)
    run.stdout.fnmatch_lines(["*expectation known.toml #6 (spec 'demo.fails') matched no test*"])
    records = {
        r["spec"]: r
        for line in results.read_text().splitlines()
        if (r := json.loads(line))["kind"] == "test"
    }
    assert records["demo.fails"]["status"] == "xfailed"
    assert records["demo.fails"]["expectation"]["link"] == "https://example.invalid/1"
    assert "torch sums twice" in records["demo.fails"]["error"]
    assert records["demo.passes"]["status"] == "xpassed"  # strict: an unexpected pass
    assert records["demo.flaky"]["status"] == "xpassed"
    assert records["demo.flaky"]["expectation"]["status"] == "flaky"
    assert records["demo.hangs"]["status"] == "skipped"
    assert "hangs in all_to_all" in records["demo.hangs"]["skip_reason"]
    assert records["demo.wrong"]["status"] == "failed"  # a KeyError is not the deviation
    # An AssertionError, as the deviation raises, but not the deviation's failure:
    other = records["demo.other"]
    assert other["status"] == "failed"
    assert (
        "a different failure in a spec with a known deviation" in other["expectation"]["mismatch"]
    )
    run.stdout.fnmatch_lines(
        ["*distconf: known deviation*", "*known.toml #7 (demo.other) expects*"]
    )
    assert records["demo.unverified"]["status"] == "xfailed"
    assert not records["demo.unverified"]["expectation"]["verified_here"]
    from harness.outcome import triage
    from harness.outcome.verdict import is_unexpected

    assert [s for s, r in sorted(records.items()) if is_unexpected(r)] == [
        "demo.other",
        "demo.passes",
        "demo.wrong",
    ]
    assert {s: triage.category(r) for s, r in records.items()} == {
        "demo.fails": "known",
        "demo.passes": "fixed",
        "demo.flaky": None,
        "demo.hangs": None,
        "demo.wrong": "different",
        "demo.other": "different",
        "demo.unverified": "unverified",
    }


def test_a_run_of_other_tests_is_not_told_of_entries_it_could_not_meet(project):
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=2", "conformance/test_demo.py::test_hangs"
    )
    run.assert_outcomes(skipped=1)
    assert "matched no test" not in run.stdout.str()


def test_an_expectation_for_an_unknown_spec_is_a_usage_error(project):
    (project.path / "expectations" / "bad.toml").write_text(
        '[[expect]]\nspec = "demo.nope"\nstatus = "skip"\nreason = "r"\nlink = "https://x.invalid"\n'
        'verified = ["2.13.0"]\n'
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--world-sizes=2")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(["*bad.toml #1: unknown spec ID 'demo.nope'*"])


SHRINK_SUITE = """
import pytest
from hypothesis import given, settings, strategies as st

def _value(ctx, x):
    return x

@pytest.mark.spec("demo.{name}")
@settings(deadline=None, derandomize=True, max_examples=100)
@given(x=st.integers(0, 10**6))
def test_{name}(world, x):
    assert world.run(_value, x)[0] < 1000, "torch is off from 1000 on"
"""


def test_a_known_deviation_is_not_shrunk_and_a_real_failure_is(pytester):
    pytester.makeini(
        "[pytest]\ndistconf_catalogue = catalogue.toml\ndistconf_suites = conformance\n"
        "distconf_expectations = expectations\n"
    )
    names = ("known", "real")
    (pytester.path / "catalogue.toml").write_text("".join(CATALOGUE.format(name=n) for n in names))
    (pytester.path / "conformance").mkdir()
    (pytester.path / "conformance" / "test_demo.py").write_text(
        "\n".join(SHRINK_SUITE.replace("{name}", name) for name in names)
    )
    (pytester.path / "expectations").mkdir()
    (pytester.path / "expectations" / "known.toml").write_text(
        '[[expect]]\nspec = "demo.known"\nstatus = "xfail"\nreason = "off from 1000 on"\n'
        'link = "https://example.invalid/1"\nfingerprint = "off from 1000"\n'
        f'verified = ["{TORCH}"]\n'
    )
    results = pytester.path / "r.jsonl"
    run = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=1", f"--distconf-results={results}"
    )
    run.assert_outcomes(xfailed=1, failed=1)
    records = {
        r["spec"]: r
        for line in results.read_text().splitlines()
        if (r := json.loads(line))["kind"] == "test"
    }
    known, real = records["demo.known"], records["demo.real"]
    # The known deviation stops at its first failing example; the real failure shrinks.
    assert known["examples"] <= known["examples_to_failure"] + 2
    assert real["examples"] > real["examples_to_failure"] + 2
    assert "x=1000" in real["falsifying_example"]


PROBE = """
[[expect]]
spec = "placements.distribute.roundtrip"
status = "flaky"
reason = "any failure"
link = "none"
fingerprint = "(?:)"
verified = ["{torch}"]
"""
"""Issue 32's probe: a flaky entry any failure of its spec would satisfy, with no link."""


def test_a_run_with_a_catch_all_expectation_is_refused_before_any_test(tmp_path):
    directory = tmp_path / "expectations"
    directory.mkdir()
    (directory / "probe.toml").write_text(PROBE.replace("{torch}", TORCH))
    out = tmp_path / "out"
    command = [
        sys.executable, "-m", "harness", "run", "--suite", "placements", "--world-sizes", "2",
        "--profile", "dev", "--seed", "1", "--jobs", "1", "--out", str(out), "--",
        "-k", "test_distribute_tensor_matches_model", "-o", f"distconf_expectations={directory}",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 4, output[-3000:]
    assert "probe.toml #1: fingerprint='(?:)' must be a regular expression found in" in output
    assert not list(out.glob("results*.jsonl")), "a test ran"


def test_params_narrow_an_entry_to_the_tests_with_one_of_its_values(tmp_path):
    (entry,) = _write(tmp_path, ENTRY.format(status="xfail", extra='params = ["masked.sum"]'))
    match = {**TEST, "torch": "2.13.0"}
    assert entry.matches(**match, params=("masked.sum",))
    assert not entry.matches(**match, params=("masked.mean",))
    assert not entry.matches(**match)
    assert entry.as_record("2.13.0")["conditions"]["params"] == ["masked.sum"]
    others = _write(tmp_path, ENTRY.format(status="xfail", extra='params = ["sum", "mean"]'))
    assert expectations.find(others, **TEST, torch="2.13.0", params=("mean",)) is not None
    assert expectations.find(others, **TEST, torch="2.13.0", params=("prod",)) is None


def test_params_must_be_a_list_of_strings(tmp_path):
    with pytest.raises(expectations.ExpectationError, match="params"):
        _write(tmp_path, ENTRY.format(status="xfail", extra="params = [3]"))
