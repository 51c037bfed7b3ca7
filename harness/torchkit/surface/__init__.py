"""The measured public API surface: the in-scope callables and options of the running torch
(``inventory``), and the recorder that notes which options each test passes, with which
values (``recorder``). ``harness run --surface`` sets ``$DISTCONF_SURFACE_DIR``; the pytest
plugin then installs the recorder in each pytest process and writes it after each test;
``python -m harness surface`` (``harness.report.surface``) measures what was recorded.

Importing this package imports no torch: the inventory and the recorder import it when
called."""

from harness.torchkit.surface.inventory import AREAS, Api, Option, inventory
from harness.torchkit.surface.recorder import (
    ENV_VAR,
    FILE_GLOB,
    OTHER,
    OUTSIDE_TESTS,
    RANK_PROCESSES,
    begin,
    end,
    flush,
    install,
    install_from_environment,
    recorded,
)

__all__ = [
    "AREAS",
    "ENV_VAR",
    "FILE_GLOB",
    "OTHER",
    "OUTSIDE_TESTS",
    "RANK_PROCESSES",
    "Api",
    "Option",
    "begin",
    "end",
    "flush",
    "install",
    "install_from_environment",
    "inventory",
    "recorded",
]
