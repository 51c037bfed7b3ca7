"""The options of a conformance run, their defaults and their validation, in one place.

``python -m harness run`` and ``mutate``, the pytest plugin's options and each of
``mutate``'s suite and fault runs describe a run with a ``RunConfig``. Its field defaults are
the only place distconf's defaults are written (the CLI's and the plugin's options take them
from here), and making one validates every field, so a bad option is refused before anything
is started, written or deleted.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from harness import catalogue
from harness.errors import (
    InvalidArgument,
    check_int,
    check_one_of,
    check_seconds,
    invalid,
    require,
)
from harness.outcome import outputs
from harness.profiles import PROFILES
from harness.runners import DEFAULT_DEVICE, DEFAULT_TIMEOUT, RUNNERS
from harness.runners.capacity import check_capacity
from harness.runners.torchrun.channel import TOKEN_VAR
from harness.runners.torchrun.world import DEFAULT_ATTACH_TIMEOUT, DEFAULT_LISTEN, TorchrunOptions


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One conformance run: which Worlds, which suites, how deep, where the records go."""

    runner: str = RUNNERS[0]
    world_sizes: tuple[int, ...] = (1, 2, 3, 4)
    """Every suite test runs once per size (that its ``world_size`` marker allows)."""
    device: str = DEFAULT_DEVICE
    """``cpu`` or an accelerator type torch knows (``cuda``, ``xpu``, ...): each rank process
    gets a device of its own, rank threads share one."""
    backend: str | None = None
    """The process runner's process-group backend (a registered name); None: the device's
    default (gloo on CPU). The thread runner always uses torch's threaded group."""
    backend_plugins: tuple[str, ...] = ()
    """Modules imported in the driver and in every rank before a process group is made: a
    vendor's backend or device registers itself there."""
    rank_timeout: float = DEFAULT_TIMEOUT
    """Seconds one ``world.run`` call may take on every rank."""
    test_timeout: float = 1800.0
    """Seconds one test may take in the driver: a backstop for a hang outside the ranks
    (pytest-timeout; 0: none)."""
    strict_collectives: bool = False
    """Process runner: check every collective's fingerprint across ranks."""
    profile: str = "ci"
    """A hypothesis profile: one of ``harness.profiles``, or one registered in this process."""
    seed: int | None = None
    """The hypothesis seed; a random profile without one gets one drawn and printed."""
    suites: tuple[str, ...] = ()
    """Suite names (``suites/test_<name>.py``); every suite when empty."""
    out: Path = Path("reports", "latest")
    """Where the results files, the report and (for ``mutate``) the logs go."""
    junit: Path | None = None
    """Also write JUnit XML here."""
    reach: bool = False
    """Record the DTensor ops every process of the run reaches, in ``OUT/reach``
    (``harness reach`` measures them)."""
    surface: bool = False
    """Record the options every test of the run passes to torch's public API, in
    ``OUT/surface`` (``harness surface`` measures them)."""
    faults: tuple[str, ...] = ()
    """Fault IDs injected for the whole run (``harness.faults``): a mutation run."""
    fault_files: tuple[str, ...] = ()
    """Python files adding faults to the catalogue."""
    cheap_first: tuple[Path, ...] = ()
    """Results (files or directories) of an earlier run: within each World, the tests it
    timed fastest go first."""
    exitfirst: bool = False
    """Stop at the first failing test (a fault run needs only one)."""
    workers: int = 1
    """pytest-xdist workers for the run (each with its own Worlds; their results are merged);
    1 runs in one process. ``mutate`` keeps 1 and runs several faults at once instead."""
    nproc_per_node: int | None = None
    """torchrun runner: start torchrun here with this many ranks per node; None: wait for
    agents started elsewhere (``--world-sizes`` then names how many)."""
    nnodes: int = 1
    """torchrun runner, started here: how many torchrun "nodes" (all on this machine)."""
    max_restarts: int = 0
    """torchrun runner, started here: torchrun's ``--max-restarts``."""
    listen: str = DEFAULT_LISTEN
    """torchrun runner: where the driver waits for agents (``HOST:PORT``; port 0: any)."""
    attach_timeout: float = DEFAULT_ATTACH_TIMEOUT
    """torchrun runner: seconds to wait for every agent to attach."""
    token_file: Path | None = None
    """torchrun runner: the shared secret's file (default: ``$DISTCONF_TOKEN``; one is made
    when torchrun is started here)."""

    def __post_init__(self) -> None:
        check_one_of("runner", self.runner, RUNNERS)
        check_world_sizes("world_sizes", self.world_sizes)
        _check_name("device", self.device, "a device type: cpu, cuda, xpu, ...")
        if self.backend is not None:
            _check_name("backend", self.backend, "a backend name or None (the device's default)")
        _check_plugins(self.backend_plugins)
        check_seconds("rank_timeout", self.rank_timeout)
        _check_backstop("test_timeout", self.test_timeout)
        _check_profile(self.profile)
        is_int = isinstance(self.seed, int) and not isinstance(self.seed, bool)
        require(self.seed is None or is_int, "seed", self.seed, "an int or None")
        for suite in self.suites:
            check_one_of("suite", suite, available_suites())
        require(isinstance(self.out, Path), "out", self.out, "a pathlib.Path")
        require(self.junit is None or isinstance(self.junit, Path), "junit", self.junit, _PATH)
        for name in ("faults", "fault_files"):
            values = getattr(self, name)
            ok = isinstance(values, tuple) and all(isinstance(v, str) and v for v in values)
            require(ok, name, values, "a tuple of non-empty strings")
        check_int("workers", self.workers)
        for path in self.cheap_first:
            require(path.exists(), "cheap_first", str(path), "a results file or a directory")
        self._check_torchrun()
        self._check_local()

    def _check_local(self) -> None:
        if self.runner != "local":
            return
        require(
            not self.faults and not self.fault_files,
            "faults" if self.faults else "fault_files",
            self.faults or self.fault_files,
            "empty with --runner local: its LocalTensorMode replaces DeviceMesh's rank and "
            "coordinate methods and every collective during a check, so faults patched there "
            "would not apply (inject them on the threads or processes runners)",
        )

    def _check_torchrun(self) -> None:
        if self.runner != "torchrun":
            for name, default in _torchrun_defaults().items():
                value = getattr(self, name)
                require(value == default, name, value, "left unset without --runner torchrun")
            return
        require(self.workers == 1, "workers", self.workers, _ONE_DRIVER)
        require(
            not self.faults,
            "faults",
            self.faults,
            "empty with --runner torchrun: faults are injected on the threads and processes "
            "runners only",
        )
        if self.nproc_per_node is not None:
            check_int("nproc_per_node", self.nproc_per_node)
            check_int("nnodes", self.nnodes)
        else:
            require(
                len(self.world_sizes) == 1,
                "world_sizes",
                self.world_sizes_text,
                "one size with --runner torchrun and no --nproc-per-node: how many agents "
                "attach (torchrun's --nnodes x --nproc-per-node)",
            )
            for name in ("nnodes", "max_restarts"):
                value = getattr(self, name)
                require(value == _torchrun_defaults()[name], name, value, _NNODES_STARTED)
        require(
            self.token_file is None or isinstance(self.token_file, Path),
            "token_file",
            self.token_file,
            _PATH,
        )
        assert self.torchrun is not None  # validates the options

    @property
    def torchrun(self) -> TorchrunOptions | None:
        """The torchrun runner's options (None on the other runners)."""
        if self.runner != "torchrun":
            return None
        launched = self.nproc_per_node
        return TorchrunOptions(
            world_size=self.world_sizes[0] if launched is None else self.nnodes * launched,
            listen=self.listen,
            attach_timeout=self.attach_timeout,
            token_file=self.token_file,
            nproc_per_node=launched,
            nnodes=self.nnodes,
            max_restarts=self.max_restarts,
        )

    def check_outputs(self) -> None:
        """Refuse an ``out`` or ``junit`` this user cannot write (a file where a directory is
        meant, a path under ``/proc``, a read-only one), before anything starts; makes
        nothing. Not part of making a ``RunConfig``: the plugin's runs write neither."""
        outputs.check_directory("out", self.out)
        if self.junit is not None:
            outputs.check_file("junit", self.junit)

    def check_machine(self, *, world_sizes: bool = True) -> str:
        """Refuse what this machine cannot run (imports torch): for the torchrun runner a
        missing token; a plugin that does not import, an absent device, a backend not
        registered for it and, with ``world_sizes``, a World too large (torchrun's ranks
        started here included); the process-group backend the Worlds will use. Each check
        is asked once, in that order."""
        if self.runner == "torchrun" and (self.nproc_per_node is None or self.token_file):
            from harness.runners.torchrun.channel import load_token

            load_token(self.token_file)  # the shared secret is there before anyone waits
        started = None
        if self.runner == "torchrun" and self.nproc_per_node is not None and world_sizes:
            started = self.nnodes * self.nproc_per_node
        return check_capacity(
            self.runner,
            self.device,
            self.world_sizes if world_sizes else (),
            backend=self.backend,
            backend_plugins=self.backend_plugins,
            started=started,
        )

    @property
    def spelled(self) -> list[str]:
        """The options of ``OPTIONS`` as the command line and the plugin spell them
        (``--runner=threads``): every one given a value, the torchrun runner's only where they
        are not their defaults (the other runners refuse them set)."""
        torchrun_defaults = _torchrun_defaults()
        spelled = []
        for option in OPTIONS:
            value = getattr(self, option.field)
            if value is None or value == () or value == torchrun_defaults.get(option.field, ()):
                continue
            shown = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            spelled.append(f"{option.spelling}={shown}")
        return spelled

    @property
    def session_world_sizes(self) -> tuple[int, ...]:
        """The world sizes the session's Worlds take: the torchrun World's size under
        torchrun (fixed for the session), else ``world_sizes``."""
        torchrun = self.torchrun
        return (torchrun.world_size,) if torchrun is not None else self.world_sizes

    @property
    def world_sizes_text(self) -> str:
        """``(1, 2, 3)`` -> ``"1,2,3"``: how the options spell it."""
        return ",".join(map(str, self.world_sizes))


_PATH = "a pathlib.Path or None"
_ONE_DRIVER = "1 with --runner torchrun: the agents attach to one driver"
_NNODES_STARTED = "for the torchrun that distconf starts here (--nproc-per-node); agents "
_NNODES_STARTED += "started elsewhere bring their own"


@functools.cache
def _torchrun_defaults() -> dict[str, Any]:
    """The torchrun runner's fields (``TORCHRUN_OPTIONS``) and their defaults."""
    names = {option.field for option in TORCHRUN_OPTIONS}
    return {field.name: field.default for field in fields(RunConfig) if field.name in names}


def as_option(error: InvalidArgument, spelled: Mapping[str, str] | None = None) -> InvalidArgument:
    """A complaint about a field as the command line and pytest spell its option
    (``world_sizes='0' must be ...`` -> ``--world-sizes='0' must be ...``); ``spelled``
    names the options that are not ``--`` and the field's name with dashes. An environment
    variable (``DISTCONF_TOKEN``, upper case) keeps its name."""
    if error.name is None or error.name.isupper():
        return error
    option = (spelled or {}).get(error.name, "--" + error.name.replace("_", "-"))
    return error.renamed(option)


def _check_backstop(name: str, value: object) -> None:
    is_number = isinstance(value, int | float) and not isinstance(value, bool)
    ok = is_number and 0 <= value < math.inf  # type: ignore[operator]
    require(ok, name, value, "a finite number of seconds >= 0 (0: none)")


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _check_name(name: str, value: object, expected: str) -> None:
    require(isinstance(value, str) and _NAME.fullmatch(value) is not None, name, value, expected)


def _check_plugins(modules: object) -> None:
    """A tuple of module names (whether they import is checked with the machine)."""
    require(isinstance(modules, tuple), "backend_plugin", modules, "a tuple of module names")
    for module in modules:  # type: ignore[attr-defined]
        ok = isinstance(module, str) and _MODULE.fullmatch(module) is not None
        require(ok, "backend_plugin", module, "a module name (package.module), importable")


def _check_profile(name: str) -> None:
    from hypothesis import settings
    from hypothesis.errors import InvalidArgument as UnknownProfile

    try:
        settings.get_profile(name)
    except UnknownProfile:
        raise invalid(
            "profile", name, f"one of {PROFILES} or a profile registered with hypothesis"
        ) from None


def check_world_sizes(name: str, sizes: object) -> None:
    """A non-empty tuple of distinct positive ints."""
    ok = (
        isinstance(sizes, tuple)
        and bool(sizes)
        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in sizes)
        and len(set(sizes)) == len(sizes)
    )
    require(ok, name, sizes, "a non-empty tuple of distinct positive ints")


def parse_world_sizes(text: str, name: str = "world_sizes") -> tuple[int, ...]:
    """``"1,2,2,4"`` -> ``(1, 2, 4)`` (repeats dropped, order kept)."""
    try:
        sizes = tuple(dict.fromkeys(int(part) for part in str(text).split(",")))
    except ValueError:
        sizes = ()
    if not sizes or any(size < 1 for size in sizes):
        raise invalid(name, text, "a comma-separated list of positive ints")
    return sizes


def world_sizes_option(
    text: str | None, runner: str, nnodes: int, nproc_per_node: int | None
) -> tuple[int, ...]:
    """``--world-sizes``, or its default: the World torchrun starts, else ``(1, 2, 3, 4)``."""
    if text is not None:
        return parse_world_sizes(text)
    if runner == "torchrun" and isinstance(nproc_per_node, int) and isinstance(nnodes, int):
        # --nnodes 0 or less is refused as itself with the World torchrun starts, not as a
        # world size it would make
        return (max(nnodes, RunConfig.nnodes) * max(nproc_per_node, 1),)
    return RunConfig.world_sizes


@dataclass(frozen=True, kw_only=True)
class RunOption:
    """An option of a run that the command line (``run``, ``mutate``) and the pytest plugin
    both take, declared once: its ``RunConfig`` field, how it parses, its one help text.
    Absent, it parses to the field's default (``DEFAULTS``)."""

    field: str
    help: str
    """What it does; ``{default}`` stands for the field's default and ``{choices}`` for the
    values it takes, as the option spells them."""
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] = ()
    metavar: str | None = None
    repeated: bool = False
    """Repeatable and comma-separated (``--backend-plugin a,b --backend-plugin c``): the field
    is the tuple of every name given, and the option is spelled in the singular."""
    derived: bool = False
    """Absent, the field is derived from the other options, not taken from ``DEFAULTS``:
    the option parses to None (``world_sizes_option``)."""

    @property
    def spelling(self) -> str:
        """``--backend-plugin`` for ``backend_plugins``."""
        name = self.field.removesuffix("s") if self.repeated else self.field
        return "--" + name.replace("_", "-")

    def keywords(self, *, prefix: str = "", choices: bool = True) -> dict[str, Any]:
        """``add_argument``'s keywords (pytest's ``addoption`` takes the same); the parsed
        value goes to ``prefix`` + the field (``dest``); ``choices``: whether argparse refuses
        another value itself."""
        default = getattr(DEFAULTS, self.field)
        shown = {"default": _shown(default), "choices": ", ".join(self.choices)}
        keywords: dict[str, Any] = {
            "dest": prefix + self.field,
            "help": self.help.format(**shown),
        }
        if self.repeated:
            keywords |= {"action": "append", "default": []}
        else:
            keywords["default"] = None if self.derived else default
        if self.type is not None:
            keywords["type"] = self.type
        if choices and self.choices:
            keywords["choices"] = self.choices
        if self.metavar is not None:
            keywords["metavar"] = self.metavar
        return keywords


def _shown(default: object) -> str:
    """A default as an option spells it: ``(1, 2)`` -> ``1,2``, ``60.0`` -> ``60``."""
    if isinstance(default, tuple):
        return ",".join(map(str, default))
    if isinstance(default, float):
        return f"{default:g}"
    return str(default)


RUN_OPTIONS = (
    RunOption(
        field="runner", choices=RUNNERS, help="how ranks are made: {choices} (default: {default})"
    ),
    RunOption(
        field="world_sizes",
        derived=True,
        help="comma-separated world sizes to run every suite test at (default: {default}; with "
        "--runner torchrun --nproc-per-node N: the size of the World it starts)",
    ),
    RunOption(
        field="device",
        help="cpu or an accelerator type torch knows: cuda, xpu, mps, hpu, a PrivateUse1 name "
        "(default: {default}); rank processes get one each, rank threads share one",
    ),
    RunOption(
        field="backend",
        help="process runner: the process-group backend, a name registered with "
        "torch.distributed (default: the device's, gloo on CPU); the thread runner always "
        "uses torch's threaded group",
    ),
    RunOption(
        field="backend_plugins",
        repeated=True,
        metavar="MODULE",
        help="a module imported in the driver and in every rank before the process group is "
        "made, to register a backend or device (repeatable or comma-separated; default: none)",
    ),
    RunOption(
        field="rank_timeout",
        type=float,
        help="seconds one world.run call may take on every rank (default: {default})",
    ),
)
"""The options of a run the command line and the pytest plugin both take (the torchrun
runner's apart): each declares them from here, and ``from_options`` makes the run of them."""
TORCHRUN_OPTIONS = (
    RunOption(
        field="nproc_per_node",
        type=int,
        help="torchrun runner: start torchrun here, N ranks per node (default: wait for agents "
        "started elsewhere)",
    ),
    RunOption(
        field="nnodes",
        type=int,
        help='torchrun runner, started here: how many "nodes", all on this machine '
        "(default: {default})",
    ),
    RunOption(
        field="max_restarts",
        type=int,
        help="torchrun runner, started here: torchrun's --max-restarts (default: {default})",
    ),
    RunOption(
        field="listen",
        help="torchrun runner: HOST:PORT the driver waits on for agents (port 0: any; "
        "default: {default})",
    ),
    RunOption(
        field="attach_timeout",
        type=float,
        help="torchrun runner: seconds to wait for every agent to attach (default: {default})",
    ),
    RunOption(
        field="token_file",
        type=Path,
        help=f"torchrun runner: the shared secret's file (default: ${TOKEN_VAR}; one is made "
        "when torchrun is started here)",
    ),
)
"""The torchrun runner's options: only that runner takes them."""
OPTIONS = RUN_OPTIONS + TORCHRUN_OPTIONS


def from_options(parsed: Mapping[str, Any], prefix: str = "", **more: Any) -> RunConfig:
    """The run of the parsed options, the one way the command line and the plugin make it:
    ``parsed`` holds what each option of ``OPTIONS`` parsed to, under ``prefix`` + its field
    (``keywords``' ``dest``); ``more`` are the fields of the options one of them alone
    declares (None: the field's default)."""
    given = {option.field: parsed[prefix + option.field] for option in OPTIONS}
    for option in OPTIONS:
        if option.repeated:
            given[option.field] = split_names(given[option.field])
    given["world_sizes"] = world_sizes_option(
        given["world_sizes"], given["runner"], given["nnodes"], given["nproc_per_node"]
    )
    return RunConfig(**given, **{name: value for name, value in more.items() if value is not None})


def split_names(values: list[str]) -> tuple[str, ...]:
    """Repeated or comma-separated options as one tuple (``["a,b", "c"]`` -> ``a, b, c``)."""
    return tuple(part for value in values for part in value.split(",") if part)


@functools.cache
def available_suites() -> tuple[str, ...]:
    """The suite names under the suites directory (``test_<name>.py``)."""
    return tuple(
        sorted(p.stem.removeprefix("test_") for p in catalogue.DEFAULT_SUITES.glob("test_*.py"))
    )


def suite_paths(config: RunConfig) -> list[Path]:
    """The files (or the directory) pytest collects for ``config.suites``."""
    if not config.suites:
        return [catalogue.DEFAULT_SUITES]
    return [catalogue.DEFAULT_SUITES / f"test_{name}.py" for name in config.suites]


DEFAULTS = RunConfig()
"""distconf's defaults: the CLI's and the plugin's options read theirs from here."""
MUTATE_OUT = Path("reports", "mutate")
"""Where ``mutate`` writes its runs, table and report unless told otherwise."""
