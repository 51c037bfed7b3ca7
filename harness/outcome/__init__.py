"""The outcome stage: what a run's records become once pytest has written them.

The data flow, in the order of its modules: ``results`` (the record schema and its JSONL
store; ``outputs``: where a run writes them, one run at a time), ``expectations`` (the known
deviations a record is held against), ``triage`` (each record's category against them),
``verdict`` (the one reading of a run: its kind, exit code and what it caught), then what is
made of a verdict: ``junit`` (the JUnit XML's verdict) and ``review`` (``harness expectations
check / update``). The HTML report (``harness.report``) reads the same records.
"""
