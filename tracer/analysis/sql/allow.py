"""What a ``run_sql`` query may call, decided on DuckDB's own parse tree after expanding macros and views (issue 30).

A name check on the statement alone misses what DuckDB's macros call: ``histogram_values('duckdb_databases',
path)`` is a table macro whose body runs ``query_table(source)``, so it read the served file's path and every
setting; ``destroy_external_resource('query', '<sql>')`` calls a function named by a string and ran any SQL.
Here every name is followed to what DuckDB will run:

- the statement's parse tree (``json_serialize_sql``) gives its functions, table functions, tables and SHOWs;
- a macro or table macro is replaced by its body (``duckdb_functions().macro_definition``, parsed the same way),
  a view of the trace DB by its query (``duckdb_views().sql``), recursively;
- a table function must be on :data:`TABLE_FUNCTIONS` (the ones reading a recording needs); a scalar, aggregate or
  window function may be any of DuckDB's except :data:`REFUSED_FUNCTIONS` (settings, variables, sequences, logs,
  and every function that takes another function's name as a string); DuckDB's catalog views that show the
  server (:data:`REFUSED_VIEWS`) are refused by name.

DuckDB (2.0) has no setting that disables a function, so this check is where ``query``, ``query_table`` and the
``*_external_resource*`` family are made impossible; the worker also opens a fresh connection for each call, so
nothing a statement could register outlives it (:mod:`tracer.analysis.sql.worker`).
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import duckdb

from tracer.analysis.sql.limits import SqlError

# Table functions a recording read needs: generated rows, unnesting, JSON columns, and the catalog of the trace's
# own tables. Everything else (query, query_table, read_*, *_external_resource*, duckdb_databases, duckdb_settings,
# logging, checkpoints) is refused by name.
TABLE_FUNCTIONS = frozenset(
    {
        "range",
        "generate_series",
        "unnest",
        "repeat",
        "repeat_row",
        "json_each",
        "json_tree",
        "duckdb_columns",
        "duckdb_constraints",
        "duckdb_dependencies",
        "duckdb_functions",
        "duckdb_indexes",
        "duckdb_keywords",
        "duckdb_schemas",
        "duckdb_tables",
        "duckdb_types",
        "duckdb_views",
        "pragma_table_info",
        "pragma_show",
        "pragma_version",
        "pg_timezone_names",
        "icu_calendar_names",
        "test_all_types",  # one row per extreme of each type: how values come back
    }
)
# Scalar and aggregate functions that answer about the server or its state rather than the trace, or call a
# function / read an object named by a string. Every other DuckDB function is allowed.
REFUSED_FUNCTIONS = frozenset(
    {
        "current_setting",
        "getenv",
        "nextval",
        "currval",
        "write_log",
        "parse_duckdb_log_message",
        "json_deserialize_sql",
        "json_execute_serialized_sql",
        "combine_aggr",
        "finalize",
        "to_aggregate_state",
        "which_secret",
    }
)
_REFUSED_PREFIXES = ("__internal",)
# Functions whose second argument names the aggregate to call (list_aggr(l, 'sum'), what DuckDB's list_sum macro
# is): allowed only with a constant name, which is then checked as a call of that function.
NAMED_BY_STRING = frozenset({"aggregate", "array_aggr", "array_aggregate", "list_aggr", "list_aggregate"})
# DuckDB's catalog views that show the server (the DB's absolute path, settings, logs, secrets): refused by name.
# The other catalog views (information_schema.*, duckdb_tables, pg_class, ...) list the trace's own tables.
REFUSED_VIEWS = frozenset(
    {
        "duckdb_databases",
        "duckdb_logs",
        "duckdb_settings",
        "duckdb_secrets",
        "pragma_database_list",
        "pg_settings",
    }
)
# Refused names that show the server (its paths, settings, extensions, logs, memory): said so in the refusal.
SERVER_STATE = frozenset(
    {
        "current_setting",
        "getenv",
        "which_secret",
        "duckdb_databases",
        "duckdb_extensions",
        "duckdb_extension_repositories",
        "duckdb_external_file_cache",
        "duckdb_log_contexts",
        "duckdb_logs",
        "duckdb_memory",
        "duckdb_secrets",
        "duckdb_settings",
        "duckdb_temporary_files",
        "pragma_database_list",
        "pragma_database_size",
        "pragma_platform",
        "pragma_user_agent",
        "pg_settings",
    }
)
SERVER_WHY = "it shows the server's configuration and paths, not the trace"
MAX_DEPTH = 32  # macros calling macros: DuckDB's own nest a few levels; a crafted chain is refused past this
_HINT = (
    "Query the trace's tables (read trace://schema, or SHOW TABLES / DESCRIBE cuda_calls) with DuckDB's scalar and "
    "aggregate functions (histogram(col) rather than the histogram table macro). Table functions allowed: "
    + ", ".join(sorted(TABLE_FUNCTIONS))
    + "."
)


@dataclass
class Calls:
    """The names one parse tree uses, lower-cased."""

    functions: set[str] = field(default_factory=set)  # scalar, aggregate and window functions (and macros)
    table_functions: set[str] = field(default_factory=set)
    relations: set[str] = field(default_factory=set)  # FROM <name>: tables, views, CTEs
    shows: set[str] = field(default_factory=set)  # SHOW <name> (a setting when not a table)
    dynamic: set[str] = field(default_factory=set)  # NAMED_BY_STRING calls whose function name is not a constant


def calls_of(tree: Any, out: Calls | None = None) -> Calls:
    """The names used in DuckDB's JSON parse tree ``tree`` (a parsed ``json_serialize_sql`` answer)."""
    out = Calls() if out is None else out
    stack = [tree]
    while stack:  # iterative: a deeply nested tree must not hit Python's recursion limit
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        fn = node.get("function")
        if kind == "TABLE_FUNCTION" and isinstance(fn, dict):
            out.table_functions.add(str(fn.get("function_name", "")).lower())
            stack.extend(v for k, v in node.items() if k != "function")
            stack.extend(v for k, v in fn.items() if k != "function_name")
            continue
        name = node.get("function_name")
        if isinstance(name, str):
            out.functions.add(name.lower())
            if name.lower() in NAMED_BY_STRING:
                named = _constant_string(node, 1)
                (out.functions if named is not None else out.dynamic).add(named or name.lower())
        if kind == "BASE_TABLE" and isinstance(node.get("table_name"), str):
            out.relations.add(node["table_name"].lower())
        if kind == "SHOW_REF" and node.get("show_type") == "SHOW" and node.get("query") is None:
            out.shows.add(str(node.get("table_name", "")).lower())
        stack.extend(node.values())
    return out


def _constant_string(call: dict[str, Any], i: int) -> str | None:
    """The ``i``-th argument of the parse tree's function ``call`` when it is a string constant, lower-cased."""
    args = call.get("arguments") or call.get("children") or []
    if len(args) <= i or not isinstance(args[i], dict):
        return None
    expr = args[i].get("expression", args[i])
    lit = expr.get("literal") if isinstance(expr, dict) and expr.get("class") == "CONSTANT" else None
    if isinstance(lit, dict) and lit.get("kind") == "STRING" and isinstance(lit.get("text"), str):
        return lit["text"].lower()
    return None


# DuckDB's own functions never change within a process: read once. (name, type) -> macro bodies
_system: dict[tuple[str, str], list[str]] | None = None
_system_lock = threading.Lock()


def _catalog_rows(conn: duckdb.DuckDBPyConnection, where: str) -> dict[tuple[str, str], list[str]]:
    rows = conn.execute(
        f"SELECT lower(function_name), function_type, macro_definition FROM duckdb_functions() WHERE {where}"
    ).fetchall()
    out: dict[tuple[str, str], list[str]] = {}
    for name, kind, body in rows:
        out.setdefault((name, kind), []).append(body or "")
    return out


# The trace DB's own macros and views (a crafted file may hold some, and they shadow DuckDB's: a DB macro named
# range is what FROM range(3) runs), by the file's identity: listing duckdb_functions() costs ~50 ms a call.
_own: dict[tuple[Any, ...], tuple[dict[tuple[str, str], list[str]], dict[str, str]]] = {}
_OWN_CACHED = 64


def _file_identity(conn: duckdb.DuckDBPyConnection) -> tuple[Any, ...] | None:
    """(path, device, inode, size, mtime) of the connection's DB file; None for an in-memory DB."""
    row = conn.execute("SELECT path FROM duckdb_databases() WHERE database_name = current_database()").fetchone()
    if not row or not row[0]:
        return None
    try:
        st = os.stat(row[0])
    except OSError:
        return None
    return (row[0], st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _catalog(conn: duckdb.DuckDBPyConnection) -> tuple[dict[tuple[str, str], list[str]], dict[str, str]]:
    """((name, function_type) -> macro bodies, DuckDB's own and the trace DB's; the DB's views: name -> SQL)."""
    global _system
    with _system_lock:
        if _system is None:
            _system = _catalog_rows(conn, "database_name = 'system'")
        key = _file_identity(conn)
        if key is not None and key in _own:
            own, views = _own[key]
        else:
            own = _catalog_rows(conn, "database_name <> 'system'")
            rows = conn.execute(
                "SELECT lower(view_name), sql FROM duckdb_views() WHERE NOT internal AND database_name <> 'system'"
            ).fetchall()
            views = dict(rows)
            if key is not None:
                if len(_own) >= _OWN_CACHED:
                    _own.clear()
                _own[key] = (own, views)
    merged = _system
    if own:
        merged = dict(_system)
        for k, v in own.items():
            merged[k] = v + merged.get(k, [])
    return merged, views


def _view_query(sql: str) -> str:
    """The query of DuckDB's ``CREATE VIEW name [(columns)] AS <query>`` text: what follows its first AS keyword."""
    for start, kind in duckdb.tokenize(sql):
        if (
            kind == duckdb.token_type.keyword
            and sql[start : start + 2].upper() == "AS"
            and not sql[start + 2 : start + 3].isalnum()
        ):
            return sql[start + 2 :].strip().rstrip(";")
    raise ValueError("no AS in the view's definition")


def _tree(conn: duckdb.DuckDBPyConnection, sql: str, what: str) -> Any:
    text = conn.execute("SELECT json_serialize_sql(?)", [sql]).fetchall()[0][0]
    tree = json.loads(text)
    if tree.get("error"):  # fail closed: what cannot be read cannot be checked
        raise SqlError(
            f"{what} could not be checked: {str(tree.get('error_message', ''))[:300]}",
            "Send one SELECT statement without parameters.",
        )
    return tree


def _refused(name: str, why: str, what: str) -> SqlError:
    via = "" if what == "the statement" else f" ({what} calls it)"
    return SqlError(f"{name} is not allowed in run_sql{via}: {why}", _HINT)


def check_calls(conn: duckdb.DuckDBPyConnection, select_sql: str) -> Calls:
    """Raise :class:`SqlError` naming the first function, table function or view of ``select_sql`` (one SELECT),
    its macros and views followed to their bodies, that run_sql does not allow; return every name it uses."""
    functions, views = _catalog(conn)
    seen: set[tuple[str, str]] = set()
    total = Calls()
    todo: list[tuple[str, str, int]] = [(select_sql, "the statement", 0)]
    while todo:
        sql, what, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise SqlError(
                f"{what} nests macros or views more than {MAX_DEPTH} deep", "Query the trace's tables directly."
            )
        calls = calls_of(_tree(conn, sql, what))
        for name in sorted(calls.table_functions):
            for body in functions.get((name, "table_macro"), []):
                if ("table_macro", name) not in seen:
                    todo.append((body, f"the table macro {name}", depth + 1))
            if (name, "table") in functions and name not in TABLE_FUNCTIONS:
                why = SERVER_WHY if name in SERVER_STATE else "only table functions that read the trace run"
                raise _refused(f"the table function {name}()", why, what)
            seen.add(("table_macro", name))
        for name in sorted(calls.dynamic):
            raise _refused(f"{name}() with a function name that is not a constant", "name the aggregate: 'sum'", what)
        for name in sorted(calls.functions):
            if name in REFUSED_FUNCTIONS or name.startswith(_REFUSED_PREFIXES):
                why = (
                    SERVER_WHY
                    if name in SERVER_STATE
                    else "it reads the server's state or names a function by a string"
                )
                raise _refused(f"{name}()", why, what)
            if ("macro", name) not in seen:
                for body in functions.get((name, "macro"), []):
                    todo.append((f"SELECT {body}", f"the macro {name}", depth + 1))
                seen.add(("macro", name))
        for name in sorted(calls.relations):
            if name in REFUSED_VIEWS:
                raise _refused(name, SERVER_WHY, what)
            if name in views and ("view", name) not in seen:
                seen.add(("view", name))
                try:
                    query = _view_query(views[name])
                except ValueError:
                    raise SqlError(f"the view {name} could not be checked", "Query the trace's tables.") from None
                todo.append((query, f"the view {name}", depth + 1))
        total.functions |= calls.functions
        total.table_functions |= calls.table_functions
        total.relations |= calls.relations
        total.shows |= calls.shows
    return total
