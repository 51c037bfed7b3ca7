"""The suites' checks: the functions every rank runs (``*_on_rank``) and the assertions that
compare what the ranks returned with the reference, one public module per area.

They build on ``harness.torchkit`` and ``harness.parity``; the suites' test modules draw the
cases and call them. Nothing under ``harness`` imports from here.
"""
