"""``run_sql``'s sandbox: one read-only statement of untrusted SQL on a trace DB, bounded in time, memory and reply.

- :mod:`.check`: DuckDB's own parser decides what may run (one statement of an allowed type);
- :mod:`.allow`: the functions and table functions a statement may call, macros and views followed to their bodies;
- :mod:`.limits`: the limits and the errors a client sees;
- :mod:`.run`: the entry point (:func:`~tracer.analysis.sql.run.run_sql`) and the statement's execution;
- :mod:`.pool`, :mod:`.fairqueue`, :mod:`.worker`: the query workers (processes killed at the wall clock), the fair
  queue per client in front of them, and the worker's side;
- :mod:`.result`: the reply (JSON-safe values, honest truncation).
"""
