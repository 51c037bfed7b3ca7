"""torch's known warnings kept off the console: counted, one example kept for the results.

pytest records every warning a test or the collection raises and lists them after the
tests. Inside pytest's own recording (its hook wrappers are the outer ones), ``sifting``
records the warnings of a block itself: those ``outcome.noise`` knows as torch's noise are
counted, and every other is raised again, as it was raised, for pytest to record and show.
The filters in force (``-W``, ``filterwarnings``) apply as before: a warning they turn into
an error is raised where it was warned, and one they ignore is not seen.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Iterator

from harness.outcome import noise


class WarningCounter:
    """The known noise one pytest process has met, by name."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.examples: dict[str, str] = {}

    @contextlib.contextmanager
    def sifting(self) -> Iterator[None]:
        caught: list[warnings.WarningMessage] = []
        try:
            with warnings.catch_warnings(record=True) as caught:
                yield
        finally:  # out of the block's catch: what is raised again goes to pytest's
            for warned in caught:
                self._sort(warned)

    def _sort(self, warned: warnings.WarningMessage) -> None:
        what = noise.known_warning(str(warned.message), warned.category, warned.filename)
        if what is None:
            with warnings.catch_warnings():
                # the filters let it through once already: "once" must not drop it now
                warnings.simplefilter("always")
                warnings.warn_explicit(
                    warned.message, warned.category, warned.filename, warned.lineno,
                    source=warned.source,
                )  # fmt: skip
            return
        self.counts[what] += 1
        self.examples.setdefault(what, f"{warned.filename}:{warned.lineno}: {warned.message}")

    def records(self) -> list[dict[str, object]]:
        return noise.records(self.counts, self.examples, source="warnings")
