"""The pytest plugin, driven through pytester on small throwaway projects."""

from __future__ import annotations

import json
import textwrap

import pytest

CATALOGUE = """
[[spec]]
id = "demo.sum"
area = "demo"
suite = "demo"
statement = "all_reduce sums."
provenance = "here"
status = "active"

[[spec]]
id = "demo.rank"
area = "demo"
suite = "demo"
statement = "ranks are numbered."
provenance = "here"
status = "active"
"""

GOOD_SUITE = """
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings, strategies as st


def _sum(ctx, value):
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    return t.item()


@pytest.mark.spec("demo.sum")
@settings(max_examples=5, deadline=None)
@given(value=st.integers(0, 9))
def test_sum(world, value):
    assert world.run(_sum, value) == [value * world.world_size] * world.world_size


@pytest.mark.spec("demo.rank")
@pytest.mark.world_size(2, 3)
def test_rank(world):
    assert world.run(lambda ctx: ctx.rank) == list(range(world.world_size))
"""


@pytest.fixture
def project(pytester):
    pytester.makeini(
        "[pytest]\ndistconf_catalogue = catalogue.toml\ndistconf_suites = conformance\n"
    )
    pytester.makefile(".toml", catalogue=CATALOGUE)
    pytester.mkdir("conformance")
    pytester.mkdir("expectations")
    return pytester


def _suite(project, source):
    (project.path / "conformance" / "test_demo.py").write_text(textwrap.dedent(source))


def _records(path):
    """The header, test and end records (``start`` records are checked on their own)."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return [record for record in records if record["kind"] != "start"]


def test_world_fixture_runs_each_test_at_every_world_size(project):
    _suite(project, GOOD_SUITE)
    results = project.path / "out" / "results.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=1,2,4", f"--distconf-results={results}", "-v"
    )
    run.assert_outcomes(passed=4)
    run.stdout.fnmatch_lines(
        ["*test_rank?threads-ws2-cpu? PASSED*", "*test_sum?threads-ws4-cpu? PASSED*"]
    )
    records = _records(results)
    assert records[0]["kind"] == "header" and records[0]["world_sizes"] == [1, 2, 4]
    assert records[-1] == {**records[-1], "kind": "end", "exitstatus": 0}
    tests = [r for r in records if r["kind"] == "test"]
    assert {(r["spec"], r["world_size"], r["status"]) for r in tests} == {
        ("demo.sum", 1, "passed"),
        ("demo.sum", 2, "passed"),
        ("demo.sum", 4, "passed"),
        ("demo.rank", 2, "passed"),
    }
    assert all(r["examples"] >= 1 for r in tests if r["spec"] == "demo.sum")


COSTLY_SUITE = """
import pytest
from hypothesis import given, settings, strategies as st

from harness.profiles import costly


@pytest.mark.spec("demo.sum")
@costly(1, needs=5)
@given(value=st.integers(0, 10**6))
def test_sum(world, value):
    assert world.run(lambda ctx: ctx.rank) == list(range(world.world_size))


@pytest.mark.spec("demo.rank")
@settings(max_examples=8, deadline=None)
@given(value=st.integers(0, 10**6))
def test_rank(world, value):
    assert world.run(lambda ctx: ctx.rank) == list(range(world.world_size))
"""


def test_a_costly_property_runs_a_share_of_its_examples_away_from_world_size_2(project):
    _suite(project, COSTLY_SUITE)
    results = project.path / "out" / "results.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=1,2,3,4", "--distconf-profile=dev",
        f"--distconf-results={results}",
    )  # fmt: skip
    run.assert_outcomes(passed=8)
    examples = {
        (r["spec"], r["world_size"]): r["examples"]
        for r in _records(results)
        if r["kind"] == "test"
    }
    # dev: 10 at world size 2 (twice the 5 it needs), a share (never under 2) at the others
    assert {size: examples["demo.sum", size] for size in (1, 2, 3, 4)} == {1: 2, 2: 10, 3: 2, 4: 3}
    assert {examples["demo.rank", size] for size in (1, 2, 3, 4)} == {8}  # not costly: as set


def test_cheap_first_runs_an_earlier_runs_fastest_tests_first_within_each_world(project):
    _suite(project, GOOD_SUITE)
    earlier = project.path / "earlier" / "results.jsonl"
    earlier.parent.mkdir()
    timed = {
        "conformance/test_demo.py::test_sum[threads-ws2-cpu]": 9.0,
        "conformance/test_demo.py::test_rank[threads-ws2-cpu]": 1.0,
    }
    earlier.write_text(
        "".join(
            json.dumps({"kind": "test", "nodeid": n, "status": "passed", "duration": d}) + "\n"
            for n, d in timed.items()
        )
    )
    run = project.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--world-sizes=2,3",
        f"--distconf-cheap-first={earlier.parent}",
        "-v",
    )
    run.assert_outcomes(passed=4)
    run.stdout.fnmatch_lines(
        [
            "*test_rank?threads-ws2-cpu? PASSED*",
            "*test_sum?threads-ws2-cpu? PASSED*",
            "*test_sum?threads-ws3-cpu? PASSED*",  # untimed: in place, after the timed ones
            "*test_rank?threads-ws3-cpu? PASSED*",
        ]
    )
    missing = project.runpytest_subprocess("-p", "no:cacheprovider", "--distconf-cheap-first=nope")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(
        ["*--distconf-cheap-first='nope' must be a results file or a directory*"]
    )


def test_world_size_marker_without_a_match_skips_visibly(project):
    _suite(project, GOOD_SUITE)
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--world-sizes=4", "-rs")
    run.assert_outcomes(passed=1, skipped=1)
    run.stdout.fnmatch_lines(["*needs a world size allowed by (2, 3); --world-sizes gave 4*"])


def test_unknown_and_missing_spec_markers_fail_collection(project):
    _suite(
        project,
        """
        import pytest

        @pytest.mark.spec("demo.nope")
        def test_unknown(world):
            pass

        def test_unmarked(world):
            pass
    """,
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(
        [
            "*suites and catalogue disagree*",
            "*test_demo.test_unknown names unknown spec ID 'demo.nope'*",
            "*test_demo.test_unmarked must carry exactly one spec marker, has []*",
            "*spec 'demo.sum' is active but no test in test_demo.py covers it*",
            "*spec 'demo.rank' is active but no test in test_demo.py covers it*",
        ]
    )


def test_selecting_one_test_does_not_hide_the_rest_of_the_module(project):
    _suite(project, GOOD_SUITE)
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=2", "conformance/test_demo.py::test_rank"
    )
    run.assert_outcomes(passed=1)


def test_catalogue_naming_a_missing_suite_is_an_error(project):
    _suite(project, GOOD_SUITE)
    (project.path / "catalogue.toml").write_text(
        CATALOGUE
        + CATALOGUE.replace("demo.", "other.")
        .replace('area = "demo"', 'area = "other"')
        .replace('suite = "demo"', 'suite = "other"')
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider")
    run.stderr.fnmatch_lines(
        ["*spec 'other.sum' names suite 'other', but test_other.py does not exist*"]
    )


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (
            "--world-sizes=1,x",
            "*--world-sizes='1,x' must be a comma-separated list of positive ints*",
        ),
        ("--world-sizes=0", "*--world-sizes='0' must be*"),
        ("--runner=mpi", "*--runner='mpi' must be one of*"),
        ("--device=tpu", "*--device='tpu' must be cpu or an accelerator type torch knows*"),
        ("--backend=gloo", "*--backend='gloo' must be unset on the thread runner*"),
        ("--backend-plugin=no_such_plugin", "*--backend-plugin='no_such_plugin' must be a mod*"),
        ("--rank-timeout=0", "*--rank-timeout=0.0 must be a positive, finite number*"),
    ],
)
def test_bad_options_are_usage_errors(project, option, message):
    _suite(project, GOOD_SUITE)
    run = project.runpytest_subprocess("-p", "no:cacheprovider", option)
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines([message])


FAILING_SUITE = """
import time
import pytest
import torch.distributed as dist
from hypothesis import given, settings, strategies as st


def _check(ctx, n):
    if ctx.rank == 1 and n >= 3:
        raise AssertionError(f"rank 1 dislikes n={n}")
    dist.barrier()


def _hang(ctx):
    if ctx.rank == 0:
        time.sleep(3600)
    dist.barrier()


@pytest.mark.spec("demo.sum")
@settings(max_examples=30, deadline=None, derandomize=True)
@given(n=st.integers(0, 100))
def test_sum(world, n):
    world.run(_check, n)


@pytest.mark.spec("demo.rank")
def test_rank(world):
    world.run(_hang)
"""


def test_failures_are_recorded_with_shrunk_example_and_rank_statuses(project):
    _suite(project, FAILING_SUITE)
    results = project.path / "results.jsonl"
    run = project.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--world-sizes=2",
        "--rank-timeout=0.5",
        f"--distconf-results={results}",
    )
    run.assert_outcomes(failed=2)
    by_spec = {r["spec"]: r for r in _records(results) if r["kind"] == "test"}
    failed = by_spec["demo.sum"]
    assert failed["status"] == "failed"
    assert "n=3" in failed["falsifying_example"]
    assert failed["primary_rank"] == 1
    assert failed["rank_statuses"] == {"0": "waiting", "1": "error"}
    assert "rank 1 dislikes n=3" in failed["error"]
    hung = by_spec["demo.rank"]
    assert hung["status"] == "timeout"
    assert hung["rank_statuses"] == {"0": "timeout", "1": "waiting"}
    assert "time.sleep(3600)" in hung["error"]


def test_interrupted_run_keeps_every_record_written(project):
    _suite(
        project,
        GOOD_SUITE
        + """

@pytest.mark.spec("demo.rank")
def test_zz_interrupt(world):
    raise KeyboardInterrupt
""",
    )
    results = project.path / "results.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=2", f"--distconf-results={results}"
    )
    assert run.ret == pytest.ExitCode.INTERRUPTED
    tests = [r for r in _records(results) if r["kind"] == "test"]
    assert [(r["spec"], r["status"]) for r in tests] == [
        ("demo.sum", "passed"),
        ("demo.rank", "passed"),
    ]


def test_plugin_is_inert_outside_the_suites(pytester):
    pytester.makepyfile(
        "import gc\n\ndef test_plain():\n    assert gc.get_threshold() == (700, 10, 10)\n"
    )
    pytester.runpytest_subprocess("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_suite_tests_run_with_the_collector_spaced_out_and_what_collection_loaded_frozen(
    project,
):
    from harness.plugin.garbage import THRESHOLDS

    _suite(project, f"""
        import gc
        import pytest

        @pytest.mark.spec("demo.sum")
        def test_sum(world):
            assert gc.get_threshold() == {THRESHOLDS!r}
            assert gc.get_freeze_count() > 10_000  # torch, the plugin, this module

        @pytest.mark.spec("demo.rank")
        def test_rank(world):
            assert gc.isenabled()  # cyclic garbage is still collected
    """)  # fmt: skip
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--world-sizes=2")
    run.assert_outcomes(passed=2)


def test_a_projects_own_world_fixture_is_left_alone(pytester):
    pytester.makepyfile("""
        import pytest

        @pytest.fixture(params=["a", "b"])
        def world(request):
            return request.param

        def test_mine(world):
            assert world in ("a", "b")
    """)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_marks_on_classes_and_modules_count_and_class_tests_are_checked(project):
    _suite(
        project,
        """
        import pytest

        pytestmark = pytest.mark.spec("demo.rank")

        def test_inherits_the_module_mark(world):
            assert world.run(lambda ctx: ctx.rank) == list(range(world.world_size))

        @pytest.mark.spec("demo.sum")
        class TestGroup:
            pass

        class TestOther:
            @pytest.mark.spec("demo.unknown")
            def test_bad(self, world):
                pass
    """,
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(
        [
            "*TestOther.test_bad must carry exactly one spec marker, has ['demo.rank', *",
            "*test_demo.TestOther.test_bad names unknown spec ID 'demo.unknown'*",
            "*spec 'demo.sum' is active but no test in test_demo.py covers it*",
        ]
    )


OUTCOMES = """
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

def test_passes():
    pass

def test_fails():
    assert 1 == 2, "one is not two"

def test_setup_error(broken):
    pass

def test_skips():
    pytest.skip("not today")

@pytest.mark.xfail(strict=True, reason="known deviation")
def test_xfails():
    raise AssertionError("the deviation")

@pytest.mark.xfail(strict=True, reason="fixed upstream?")
def test_strict_xpass():
    pass

@pytest.mark.xfail(strict=False, reason="maybe fixed")
def test_loose_xpass():
    pass

@pytest.mark.timeout(1, method="signal")
def test_times_out():
    time.sleep(30)
"""


def test_every_outcome_gets_its_own_status(pytester):
    pytester.makepyfile(test_outcomes=OUTCOMES)
    results = pytester.path / "r.jsonl"
    pytester.runpytest_subprocess("-p", "no:cacheprovider", f"--distconf-results={results}")
    records = {r["nodeid"].split("::")[-1]: r for r in _records(results) if r["kind"] == "test"}
    statuses = {name: record["status"] for name, record in records.items()}
    assert statuses == {
        "test_passes": "passed",
        "test_fails": "failed",
        "test_setup_error": "error",
        "test_skips": "skipped",
        "test_xfails": "xfailed",
        "test_strict_xpass": "xpassed",
        "test_loose_xpass": "xpassed",
        "test_times_out": "timeout",
    }
    assert "one is not two" in records["test_fails"]["error"]
    assert "fixture broke" in records["test_setup_error"]["error"]
    assert records["test_skips"]["skip_reason"] == "not today"
    assert "the deviation" in records["test_xfails"]["error"]
    assert records["test_xfails"]["skip_reason"] == "known deviation"
    assert "[XPASS(strict)] fixed upstream?" in records["test_strict_xpass"]["error"]


def test_runner_marker_skips_other_runners_visibly(project):
    _suite(
        project,
        GOOD_SUITE.replace(
            "@pytest.mark.world_size(2, 3)",
            "@pytest.mark.world_size(2, 3)\n"
            '@pytest.mark.runner("processes", reason="uses process-global state")',
        ),
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--world-sizes=2", "-rs")
    run.assert_outcomes(passed=1, skipped=1)
    run.stdout.fnmatch_lines(["*needs the processes runner: uses process-global state*"])


@pytest.mark.parametrize("in_ci", [False, True], ids=["local", "CI=true"])
def test_report_profile_runs_with_a_recorded_seed(project, monkeypatch, in_ci):
    # Under a CI variable hypothesis makes its derandomized ``ci`` profile the default, the
    # parent of every profile registered without its own derandomize.
    if in_ci:
        monkeypatch.setenv("CI", "true")
    else:
        for variable in ("CI", "GITHUB_ACTIONS", "TF_BUILD", "BUILDKITE", "CIRCLECI"):
            monkeypatch.delenv(variable, raising=False)
    _suite(project, GOOD_SUITE)
    results = project.path / "r.jsonl"
    run = project.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--world-sizes=2",
        "--distconf-profile=report",
        f"--distconf-results={results}",
    )
    run.assert_outcomes(passed=2)
    header, *tests, _end = _records(results)
    assert header["profile"] == "report" and header["seed"].isdigit()
    assert all(t["seed"] == header["seed"] and t["profile"] == "report" for t in tests)
    assert all(f"--hypothesis-seed={header['seed']}" in t["reproduce"] for t in tests)


def test_unknown_distconf_profile_is_a_usage_error(project):
    _suite(project, GOOD_SUITE)
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--distconf-profile=fast")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(["*--distconf-profile='fast' must be one of*"])


OTHER_WORLDS_SUITE = """
import pytest
from hypothesis import given, settings, strategies as st


def _size(ctx):
    return ctx.world_size


@pytest.mark.spec("demo.sum")
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_sum(world, worlds, data):
    assert worlds.sizes == (1, 3)
    assert worlds.get(world.world_size) is world
    other = data.draw(st.sampled_from(worlds.sizes))
    assert worlds.get(other).run(_size) == [other] * other
    with pytest.raises(ValueError, match=r"world_size=2 must be one of .* \\(1, 3\\)"):
        worlds.get(2)


@pytest.mark.spec("demo.rank")
def test_rank(world):
    assert world.run(_size) == [world.world_size] * world.world_size
"""


def test_worlds_fixture_serves_the_sessions_other_sizes_and_reproduces_with_them(project):
    _suite(project, OTHER_WORLDS_SUITE)
    results = project.path / "r.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=1,3", f"--distconf-results={results}"
    )
    run.assert_outcomes(passed=4)
    tests = {(t["spec"], t["world_size"]): t for t in _records(results) if t["kind"] == "test"}
    assert "--world-sizes=1,3" in tests["demo.sum", 1]["reproduce"]
    assert "test_sum[threads-ws1-cpu]" in tests["demo.sum", 1]["reproduce"]
    assert "--world-sizes=3 " in tests["demo.rank", 3]["reproduce"]


def test_an_unknown_spec_outside_the_suites_is_a_usage_error(project):
    _suite(project, GOOD_SUITE)
    project.makepyfile(
        test_elsewhere="""
        import pytest

        @pytest.mark.spec("demo.nosuch")
        def test_checks_nothing_known(world):
            pass

        @pytest.mark.spec("another project's marker")
        def test_not_distconfs():
            pass
        """
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "test_elsewhere.py")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(
        ["*test_elsewhere.py::test_checks_nothing_known names unknown spec ID 'demo.nosuch'*"]
    )
    assert "another project" not in run.stderr.str()


def test_a_missing_expectations_directory_is_a_usage_error(project):
    _suite(project, GOOD_SUITE)
    project.makeini(
        "[pytest]\ndistconf_catalogue = catalogue.toml\ndistconf_suites = conformance\n"
        "distconf_expectations = expectatoins\n"
    )
    run = project.runpytest_subprocess("-p", "no:cacheprovider", "--world-sizes=2")
    assert run.ret == pytest.ExitCode.USAGE_ERROR
    run.stderr.fnmatch_lines(["*expectations directory '*expectatoins' does not exist*"])


def test_start_records_name_each_test_before_its_outcome(project):
    _suite(project, GOOD_SUITE)
    results = project.path / "r.jsonl"
    run = project.runpytest_subprocess(
        "-p", "no:cacheprovider", "--world-sizes=2", f"--distconf-results={results}"
    )
    run.assert_outcomes(passed=2)
    records = [json.loads(line) for line in results.read_text().splitlines()]
    kinds = [(r["kind"], r.get("nodeid")) for r in records[1:-1]]
    tests = [nodeid for kind, nodeid in kinds if kind == "test"]
    assert kinds == [pair for nodeid in tests for pair in (("start", nodeid), ("test", nodeid))]
