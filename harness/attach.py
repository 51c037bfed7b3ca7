"""``torchrun ... -m harness.attach --driver HOST:PORT``: serve a distconf driver as one rank
(see ``harness.runners.torchrun.agent`` and README's "Several machines")."""

from __future__ import annotations

if __name__ == "__main__":
    from harness.runners.torchrun.agent import main

    raise SystemExit(main())
