"""A whole ``harness run`` tells a known deviation from a different failure in its spec, and
a deviation verified on this torch from one that is not (summary, report, JUnit, exit code).

These run one real spec with a known torch deviation on the installed torch,
``state_dict.optim.get_has_no_side_effect`` (its deviation is present on 2.13 and 2.15);
an expectations directory of the test's own fixes what is known and where it was verified.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from xml.etree import ElementTree

from harness.outcome import expectations, review

ROOT = Path(__file__).resolve().parent.parent
SECOND_BUG = ROOT / "tests" / "fixtures" / "second_bug" / "faults.py"
SPEC = "state_dict.optim.get_has_no_side_effect"


def _known(tmp_path: Path, *, verified: list[str] | None = None) -> Path:
    """An expectations directory holding the shipped entry for SPEC only (its ``verified``
    replaced when given)."""
    directory = tmp_path / "expectations"
    directory.mkdir()
    (entry,) = [e for e in expectations.load() if e.spec == SPEC]
    name, _, number = entry.source.rpartition(" #")
    text = (expectations.DEFAULT_DIR / name).read_text()
    if verified is not None:
        text = review.set_field(text, int(number) - 1, "verified", verified)
    kept = tomllib.loads(text)["expect"][int(number) - 1]
    lines = [f"{key} = {review.toml_value(value)}" for key, value in kept.items()]
    (directory / "known.toml").write_text("[[expect]]\n" + "\n".join(lines) + "\n")
    return directory


def _run(tmp_path: Path, directory: Path, *pytest_args: str) -> tuple[int, str]:
    out = tmp_path / "out"
    tmp_path.mkdir(exist_ok=True)
    command = [
        sys.executable, "-m", "harness", "run", "--suite", "state_dict", "--world-sizes", "2",
        "--profile", "dev", "--seed", "1", "--jobs", "1", "--out", str(out),
        "--junit", str(out / "junit.xml"), "--",
        "-k", "leaves_training_alone", "-o", f"distconf_expectations={directory}", *pytest_args,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def _junit_verdict(out: Path) -> str | None:
    suite = next(ElementTree.parse(out / "junit.xml").getroot().iter("testsuite"))
    return {p.get("name"): p.get("value") for p in suite.iter("property")}["distconf_verdict"]


def test_the_known_deviation_holds_and_a_second_bug_beside_it_fails_the_run(tmp_path):
    directory = _known(tmp_path)
    code, output = _run(tmp_path / "clean", directory)
    assert code == 0, output[-3000:]
    assert "known deviation" in output

    code, output = _run(
        tmp_path / "fault",
        directory,
        f"--distconf-fault-files={SECOND_BUG}",
        "--distconf-faults=fixture.init_optim_state_moves_parameters",
    )
    assert code == 6, output[-3000:]
    assert "verdict: changed:" in output
    assert f"{SPEC}: fails otherwise than its known deviation (known.toml #1)" in output
    html = (tmp_path / "fault" / "out" / "report.html").read_text()
    assert '<section class="verdict changed"' in html and 'id="versions"' in html
    assert _junit_verdict(tmp_path / "fault" / "out") == "changed"


def test_a_deviation_not_verified_on_this_torch_is_held_but_not_green(tmp_path):
    directory = _known(tmp_path, verified=["2.12.0"])
    code, output = _run(tmp_path, directory)
    assert code == 8, output[-3000:]
    assert "verdict: unverified:" in output
    assert "known (verified on 2.12.0) (known.toml #1)" in output
    assert (
        review.update([tmp_path / "out"], directory, verified=True, fixed=False, dry_run=False) == 0
    )
    assert [e.verified for e in expectations.load(directory)] == [
        ("2.12.0", review.read_run([tmp_path / "out"]).torch)
    ]
