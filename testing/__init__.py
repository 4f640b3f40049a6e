"""Helpers for tests and benchmarks (``netagg.testing``): a software switch with its jobs in process
(:mod:`.softswitch`), workers and a PS on loopback and the exact sums they must reach (:mod:`.hoststack`),
MLfabric's PS, scheduler and workers wired together (:mod:`.mlfabric`).

The top layer of the package (docs/architecture.md, "Layers"): it may import every other part, and no product
module imports it.
"""
