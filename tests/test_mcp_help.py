"""`tracer mcp serve --help` names every tool the server registers (it once listed 4 of 6)."""

from __future__ import annotations

import anyio
from mcp import Client

from mcp_server.server import build_server
from tracer.commands.analysis import MCP_SERVE_HELP


def test_help_names_every_tool(tmp_path):
    async def names() -> set[str]:
        async with Client(build_server(tmp_path / "none.duckdb")) as c:
            return {t.name for t in (await c.list_tools()).tools}

    tools = anyio.run(names)
    assert len(tools) >= 6
    text = " ".join(MCP_SERVE_HELP.split())
    assert sorted(n for n in tools if n not in text) == []
    # and each paragraph is one line: rich prints a help text's line breaks as they are (it once broke mid-list)
    assert all("\n" not in para for para in MCP_SERVE_HELP.split("\n\n"))
