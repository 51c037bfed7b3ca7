"""nox sessions for distconf.

Every default session pins torch==2.13.0, which pip installs from a local CPU wheel here; an
unpinned torch (or any other version) downloads several GB of CUDA packages. Only the opt-in
``torch`` session installs other versions, and it says so.
"""

from __future__ import annotations

import glob
import os
import shutil

import nox

TORCH = "torch==2.13.0"
REPORTS = "reports"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The harness's own tests."""
    session.install(TORCH, "-e", ".[dev]")
    session.run("python", "-m", "pytest", *(session.posargs or ["-n", "auto"]))


@nox.session
def conformance(session: nox.Session) -> None:
    """The suites on the thread and the process runner, CPU; one report under reports/."""
    session.install(TORCH, "-e", ".")
    out = os.path.join(REPORTS, "conformance")
    for runner in ("threads", "processes"):
        session.run(
            "python",
            "-m",
            "harness",
            "run",
            "--runner",
            runner,
            "--out",
            os.path.join(out, runner),
            *session.posargs,
        )
    _render(session, os.path.join(out, "report.html"), os.path.join(out, "*", "results*.jsonl"))


@nox.session
def large_worlds(session: nox.Session) -> None:
    """The DTensor-level suites at world sizes no host holds as threads or processes, on the
    local runner (every rank simulated in one thread): world sizes 8, 16 and 64 by default;
    ``-- --world-sizes 128,256 --profile ci`` for more."""
    session.install(TORCH, "-e", ".")
    session.run(
        "python",
        "-m",
        "harness",
        "run",
        "--runner",
        "local",
        "--suite",
        "placements,uneven",
        "--world-sizes",
        "8,16,64",
        "--profile",
        "dev",
        "--out",
        os.path.join(REPORTS, "large-worlds"),
        *session.posargs,
    )


@nox.session
def gpu(session: nox.Session) -> None:
    """The suites on the accelerator torch sees (CUDA, XPU, ...): threads sharing one device,
    then rank processes with a device each and the device's default backend (nccl on CUDA).

    Skips, saying so, where torch sees no accelerator; a GPU job that must not skip passes
    ``-- --require-gpus``.
    """
    session.install(TORCH, "-e", ".[dev]")
    found = session.run(
        "python",
        "-c",
        "import torch; a = torch.accelerator.current_accelerator(); "
        "print(a.type if a is not None else 'none', torch.accelerator.device_count())",
        silent=True,
    )
    kind, count = str(found or "none 0").strip().splitlines()[-1].split()
    if kind == "none" or int(count) == 0:
        session.skip("torch sees no accelerator (torch.accelerator.current_accelerator() is None)")
    out = os.path.join(REPORTS, "gpu")
    for runner in ("threads", "processes"):
        session.run(
            "python",
            "-m",
            "harness",
            "run",
            "--runner",
            runner,
            "--device",
            kind,
            "--out",
            os.path.join(out, runner),
            *session.posargs,
        )
    _render(session, os.path.join(out, "report.html"), os.path.join(out, "*", "results*.jsonl"))


@nox.session
def report(session: nox.Session) -> None:
    """Render a report from results files: ``nox -s report -- RESULTS... [-o FILE.html]``."""
    session.install(TORCH, "-e", ".")
    args = session.posargs or [os.path.join(REPORTS, "latest", "results.jsonl")]
    session.run("python", "-m", "harness", "report", *args)


@nox.session
def browser(session: nox.Session) -> None:
    """Render the fixture report and screenshot it in headless Chromium (Debian's chromium)."""
    if shutil.which("chromium") is None:
        session.error("chromium is not installed: apt-get install chromium")
    session.install(TORCH, "-e", ".")
    html = os.path.join(REPORTS, "fixture-report.html")
    fixtures = os.path.join("tests", "fixtures", "report")
    session.run(
        "python",
        "-m",
        "harness",
        "report",
        fixtures,
        "--baseline",
        os.path.join(fixtures, "baseline"),
        "--catalogue",
        os.path.join(fixtures, "catalogue.toml"),
        "-o",
        html,
    )
    session.run(
        "python",
        "-m",
        "harness.report.screenshot",
        html,
        os.path.join(REPORTS, "fixture-report.png"),
    )


@nox.session
def mutate(session: nox.Session) -> None:
    """The detection score: a clean run, then one run per fault (prints the table)."""
    session.install(TORCH, "-e", ".")
    out = os.path.join(REPORTS, "mutate")
    session.run("python", "-m", "harness", "mutate", "--out", out, *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Benchmark figures: examples/s of the properties, world.run against spawn-per-check."""
    session.install(TORCH, "-e", ".")
    session.run("python", "-m", "harness", "bench", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install(TORCH, "-e", ".[dev]")
    session.run("mypy")


NIGHTLY_INDEX = "https://download.pytorch.org/whl/nightly/cpu"


@nox.session(default=False)
@nox.parametrize("version", ["2.13.0", "2.15.0", "nightly"])
def torch(session: nox.Session, version: str) -> None:
    """Opt-in: the conformance run on another torch, then what it says of each known deviation
    (``harness expectations check``). 2.15.0 comes from the registry with its CUDA packages
    (several GB); nightly is the newest CPU nightly, pinned to its exact version."""
    if version == "nightly":
        pinned = _newest_nightly(session)
        session.install("--pre", f"torch=={pinned}", "--index-url", NIGHTLY_INDEX)
    else:
        if version != "2.13.0":
            session.warn(f"torch {version} is not the local CPU wheel: pip downloads several GB")
        session.install(f"torch=={version}")
    session.install("-e", ".")
    out = os.path.join(REPORTS, f"torch-{version}")
    # Exit 8 (deviations held but not verified on this torch) still lists them below.
    session.run(
        "python", "-m", "harness", "run", "--out", out, *session.posargs, success_codes=[0, 8]
    )
    session.run("python", "-m", "harness", "expectations", "check", out, success_codes=[0, 1])


def _newest_nightly(session: nox.Session) -> str:
    """The newest torch on the CPU nightly index for this Python; skips, saying why, where
    the index cannot be reached."""
    import re
    import sys
    import urllib.error
    import urllib.request

    from packaging.version import Version

    try:
        with urllib.request.urlopen(f"{NIGHTLY_INDEX}/torch/", timeout=20) as page:
            listing = page.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError) as exc:
        session.skip(f"the CPU nightly index {NIGHTLY_INDEX} cannot be reached: {exc}")
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    found = re.findall(rf"torch-([0-9][^-]*?)(?:%2B|\+)cpu-{tag}-{tag}-", listing)
    if not found:
        session.skip(f"{NIGHTLY_INDEX} lists no CPU torch for {tag}")
    return str(max(found, key=Version)) + "+cpu"


def _render(session: nox.Session, html: str, pattern: str) -> None:
    files = sorted(glob.glob(pattern))
    if not files:
        session.error(f"no results match {pattern}")
    session.run("python", "-m", "harness", "report", *files, "-o", html)
