"""nox sessions for distconf. Every session pins torch==2.13.0 (a local CPU wheel); an
unpinned torch would download several GB of CUDA packages."""

from __future__ import annotations

import nox

TORCH = "torch==2.13.0"
nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True


@nox.session
def tests(session: nox.Session) -> None:
    """The harness's own tests."""
    session.install(TORCH, "-e", ".[dev]")
    session.run("python", "-m", "pytest", *session.posargs)


@nox.session
def conformance(session: nox.Session) -> None:
    """The conformance suites on the thread runner, CPU; results under reports/conformance."""
    session.install(TORCH, "-e", ".")
    session.run("python", "-m", "harness", "run", "--out", "reports/conformance", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    """Examples per second of the placement properties at world size 4."""
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
