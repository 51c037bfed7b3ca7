"""``torchrun ... -m harness.attach --driver HOST:PORT``: serve a distconf driver as one rank
(see ``harness.runners._agent`` and README's "Several machines")."""

from __future__ import annotations

if __name__ == "__main__":
    from harness.runners._agent import main

    raise SystemExit(main())
