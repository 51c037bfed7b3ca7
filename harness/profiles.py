"""distconf's hypothesis profiles (registered on import).

- ``dev``: 10 examples, random: quick iteration.
- ``ci``: hypothesis' own profile (100 examples, derandomized, no database, no deadline),
  which hypothesis loads by itself when it detects CI; distconf does not replace it for every
  project the plugin is installed in.
- ``nightly``: 1000 examples, random.
- ``report``: 200 examples, reproducible from the seed recorded with the results, no
  database replaying old failures.

A run under a random profile (every one but ``ci``) without a seed gets one drawn and
recorded (``needs_seed``), so that any run can be repeated.
"""

from __future__ import annotations

from hypothesis import Phase, settings

from harness.errors import check_int

PROFILES = ("dev", "ci", "nightly", "report")

# derandomize=False is stated, not inherited: a profile's unset fields come from the default
# settings, which under a CI environment variable are hypothesis' derandomized ``ci``.
settings.register_profile("dev", max_examples=10, deadline=None, derandomize=False)
settings.register_profile("nightly", max_examples=1000, deadline=None, derandomize=False)
settings.register_profile(
    "report", max_examples=200, database=None, deadline=None, derandomize=False
)


def describe_profiles() -> str:
    """Each profile in a few words, as ``--profile``'s help says it:
    ``dev 10 examples, random; ...``."""
    return "; ".join(
        f"{name} {settings.get_profile(name).max_examples} examples, "
        f"{'derandomized' if settings.get_profile(name).derandomize else 'random'}"
        for name in PROFILES
    )


def needs_seed(profile: str) -> bool:
    """Whether a run under ``profile`` must draw (and record) a seed to be repeatable: the
    profile draws at random."""
    return not settings.get_profile(profile).derandomize


def property_settings(*, whole_at: int = 2) -> settings:
    """Settings for a property over a World: the loaded profile's examples at world size
    ``whole_at`` and a share of them at the others (``examples_at``), without hypothesis'
    per-example deadline, which would misfire on the first example of a World (process-group
    and mesh creation); World.run enforces its own. ``whole_at`` is 2 unless a runner serves
    the property at one world size only.

    A settings object takes what it leaves unset from the profile loaded when it is made, and
    this module is imported before the run's profile is loaded: a suite makes its settings at
    import (``PROPERTY = property_settings()``), never this module."""
    check_int("whole_at", whole_at)
    made = settings(deadline=None)
    _SHARED.append((made, whole_at))
    return made


def costly(cost: int, *, whole_at: int = 2, needs: int = 0) -> settings:
    """Settings for a property whose examples cost about ``cost`` times a placement
    example's: at the wide profiles (``goes_wide``) ``1/cost`` of the loaded profile's example
    budget, at the others half of that (at least 2), at world size ``whole_at``, and a share
    of those at the others (``examples_at``), so a profile bounds the time of a run rather
    than its example count. ``needs``: the most examples ``mutate`` has needed at ``whole_at``
    to catch a fault through this property, which the budget always buys twice over (never
    more than the profile's budget). ``whole_at`` is 2 (where ``mutate`` catches most of the
    catalogue's faults first, world size 1 rarely showing a distributed fault) unless a
    runner serves the property at one world size only. No per-example deadline: World.run
    enforces its own (the first example of a World builds it).

    Why half below the wide profiles: README's run (the ci profile) took 9 minutes on the
    2-core machine at ``1/cost``, against a target of 5, and of two samples of 48 faults
    ``mutate`` ran on the halved budgets, those a costly property caught met their first
    failing example within 9 examples, but for the properties that state ``needs``; the wide
    profiles keep the whole share.

    How a suite picks ``cost`` for its costliest properties: so that the property's ci run
    over world sizes 1-4 takes about 5 s on the 2-core CI machine at ``1/cost``, but never
    fewer than 8 examples there; a property whose ci run took 5-8 s at the full budget and
    where ``mutate`` catches no fault, or one within 3 examples, takes half
    (``costly(2)``). The suite states the measured time an example next to its ``costly``."""
    check_int("cost", cost)
    check_int("whole_at", whole_at)
    check_int("needs", needs, minimum=0)
    budget = settings.default.max_examples if settings.default else 100
    share = budget // cost if budget >= WIDE_BUDGET else budget // (2 * cost)
    made = settings(deadline=None, max_examples=min(budget, max(2, share, 2 * needs)))
    _SHARED.append((made, whole_at))
    return made


_SHARED: list[tuple[settings, int]] = []
"""Every settings object ``costly`` and ``property_settings`` made, with its ``whole_at``: the
properties whose examples a World's size divides (``examples_at``)."""


def whole_at(made: settings) -> int | None:
    """The world size where a property with settings ``made`` runs its whole budget; None:
    ``made`` came from neither ``costly`` nor ``property_settings`` (a suite's own settings,
    run as they are)."""
    return next((size for shared, size in _SHARED if shared is made), None)


def examples_at(
    world_size: int, max_examples: int, whole_at: int = 2, run_sizes: tuple[int, ...] = ()
) -> int:
    """A property's examples at ``world_size``, of its ``max_examples`` at world size
    ``whole_at``: all of them there, an eighth at world size 1, half at 2, a quarter at 3, a
    third from 4 on; never fewer than 2 (nor more than the budget). A run whose world sizes
    (``run_sizes``, when given) lack ``whole_at`` runs the whole budget at its smallest
    instead: the shares stand for what world size ``whole_at`` draws, and a run of world size
    3 alone (a vendor's backend checked there) would otherwise draw a quarter of it.

    Why: rank threads share one interpreter, so an example at world size n costs about n
    times a rank's work (at the ci profile, 108 s of test time at world size 1, 281 at 2,
    235 at 3 and 386 at 4, when they ran a quarter, all, half and half), while the other
    worlds are there for what only they show: one rank's degenerate mesh (the catalogue's
    faults that show there show at 2 as well), the uneven split of 3 (every example there
    draws one), the 2-D meshes from 4. ``mutate`` at the same profile measures what the
    shares still catch: a quarter at 4 lost a fault only a 2-D mesh shows, which
    optim.fsdp.mixed_precision met at its sixth example there (its ``needs`` keeps twice that
    at 4 now); a quarter at 1 lost one that optim.knobs.checkpointing_dropout, which rank
    threads serve at world size 1 only, met at its third (it runs its whole budget there:
    ``whole_at``)."""
    check_int("world_size", world_size)
    check_int("max_examples", max_examples)
    if run_sizes and whole_at not in run_sizes:
        whole_at = min(run_sizes)
    divisor = 1 if world_size == whole_at else {1: 8, 2: 2, 3: 4}.get(world_size, 3)
    return min(max_examples, max(2, max_examples // divisor))


HANG_DEADLINE = 3.0
"""Seconds a ``hanging`` property gives each call: its failing example waits it out twice
(the example, then hypothesis' replay of it) at every world size, while a call that does not
hang returns in milliseconds (these properties draw small cases)."""


def hanging() -> settings:
    """Settings for a property whose failing example hangs its ranks until World.run's
    deadline (where the process runner kills them): three examples, never shrunk, since each
    shrink step would hang again."""
    return settings(deadline=None, max_examples=3, phases=(Phase.explicit, Phase.generate))


WIDE_BUDGET = 200
"""The example budget from which a profile goes wide (``report``, ``nightly``)."""


def goes_wide() -> bool:
    """Whether the loaded profile goes wide: a suite that runs a share of a large table (the
    ops suite's OpInfos) at the other profiles runs all of it. Asked at collection, once the
    run's profile is loaded."""
    budget = settings.default.max_examples if settings.default else 100
    return budget >= WIDE_BUDGET
