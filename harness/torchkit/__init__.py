"""The torch toolkit the suites' checks use inside ranks.

DTensor views and the op table (``dtensor``, ``dtensor_ops``), the models suites train
(``models``, ``module_graphs``), optimizers and the single-device reference run (``optim``),
the training steps of every parallel layout (``training``), collective counting
(``collectives``), process-wide contexts (``shared_contexts``), the per-rank context a check
receives (``context``) and the private torch internals distconf touches (``internals``).

Nothing here draws data or knows a runner: a check built from these pieces runs the same on
threads and processes, CPU and accelerators. Nothing here imports the engine (plugin,
session, report) or ``suites``.
"""
