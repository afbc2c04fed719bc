"""Distributed jobs: which process is which rank, each rank's time by phase, and the straggler the others wait for.

Modules: ``phases`` (a rank's time split into phases, its blocked time by who ended each wait), ``table`` (the ranks
over the window they all stepped in), ``straggler`` (the slow rank, its phase, who waits and when), ``sites`` (where
in its step the straggler's extra time and the others' waits lie, between which code lines), ``report`` (the
per-rank table and the straggler as records, for ``tracer ranks`` and the ``get_ranks`` MCP tool). The causal chain
is ``tracer.analysis.chains.straggler_rank``. Nothing here imports the chains package, which imports this one.
"""
