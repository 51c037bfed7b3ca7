"""For the tests that interrupt a child process with SIGINT."""

import signal


def default_sigint() -> None:
    """A ``preexec_fn`` that gives the child SIGINT's default disposition. A shell without job
    control starts background commands (``cmd &``, ``nohup``) with SIGINT ignored, children
    inherit that, and a Python started so never raises KeyboardInterrupt: the interrupt
    tests must not depend on how pytest itself was started."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
