"""SQL text built from names and values: the one quoting of a string literal and an identifier (the recorder's
paths in ATTACH and SET, the readers' views), and the one union view the readers read a table through over several
sources (a job's recordings, a Parquet dataset's files)."""

from __future__ import annotations

from tracer.schema import TABLE_BY_NAME


def literal(s: str) -> str:
    """Return ``s`` as a SQL string literal."""
    return "'" + s.replace("'", "''") + "'"


def ident(name: str) -> str:
    """Return ``name`` as a quoted SQL identifier."""
    return '"' + name.replace('"', '""') + '"'


def union_view(table: str, parts: list[tuple[str, list[str]]]) -> str:
    """Return the SELECT behind ``table``'s view over ``parts`` ((a SELECT, its columns) each): their union by
    name, the schema's columns in its order, then any others (added or unknown) by name."""
    order = {c: n for n, c in enumerate(TABLE_BY_NAME[table].column_names)}
    every = sorted({c for _, cols in parts for c in cols}, key=lambda c: (order.get(c, len(order)), c))
    union = " UNION ALL BY NAME ".join(sql for sql, _ in parts)
    return f"SELECT {', '.join(ident(c) for c in every)} FROM ({union})"
