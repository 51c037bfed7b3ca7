"""``python -m harness mutate``: the detection score of the suites against the fault
catalogue (``mutate``), each run a forked ``session.run`` (``launcher``)."""
