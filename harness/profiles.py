"""distconf's hypothesis profiles (registered on import).

- ``dev``: 10 examples, random: quick iteration.
- ``ci``: hypothesis' own profile (100 examples, derandomized, no database, no deadline),
  which hypothesis loads by itself when it detects CI; distconf does not replace it for every
  project the plugin is installed in.
- ``nightly``: 1000 examples, random.
- ``report``: 200 examples, reproducible from the seed recorded with the results (runs with
  ``--distconf-profile report`` or ``harness run --profile report`` always get an explicit
  seed), no database replaying old failures.
"""

from __future__ import annotations

from hypothesis import settings

PROFILES = ("dev", "ci", "nightly", "report")
SEEDED = ("report",)
"""Profiles that must run with an explicit, recorded seed."""

settings.register_profile("dev", max_examples=10, deadline=None)
settings.register_profile("nightly", max_examples=1000, deadline=None)
settings.register_profile("report", max_examples=200, database=None, deadline=None)


def costly(cost: int) -> settings:
    """Settings for a property whose examples cost about ``cost`` times a placement
    example's: the loaded profile's example budget buys ``1/cost`` of the examples (at least
    2), so a profile bounds the time of a run rather than its example count. No per-example
    deadline: World.run enforces its own (the first example of a World builds it)."""
    if not (isinstance(cost, int) and cost >= 1):
        raise ValueError(f"cost={cost!r} must be an int >= 1")
    budget = settings.default.max_examples if settings.default else 100
    return settings(deadline=None, max_examples=max(2, budget // cost))
