"""MLfabric for netagg: bounded-delay async updates, network-aware update ordering, a replicated PS.

See docs/mlfabric.md. Entry points: ``async_server.FabricServer`` (and ``python -m
netagg.mlfabric.async_server``), ``worker.FabricClient``, ``training.run_worker``,
``scheduler.Scheduler``.
"""
