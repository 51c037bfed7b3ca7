"""The torchrun runner: ranks started by torchrun, on this machine or several, attach to the
driver.

``world`` is the runner (``TorchrunWorld``, its options, where the driver waits); the rest is
what it is made of: ``listener`` (the driver's end of the authenticated channel: connections
admitted, capped and held to one deadline), ``channel`` (the token, the HMAC handshake both
ways, the agent's end), ``attached`` (the driver's side of a set of attached agents: arrivals,
calls, repair), ``launch`` (torchrun started here, with ``--nproc-per-node``, bound to
loopback) and ``agent`` (what ``python -m harness.attach`` runs on each torchrun worker).
"""
