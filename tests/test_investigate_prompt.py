"""The MCP server's investigation order (issue 23): the `investigate` prompt and the server's instructions walk an
assistant through the breakdown, the chains, the step series and the stacks, in that order, and say what each of
those tools cannot see."""

from __future__ import annotations

import anyio
import pytest
from mcp import Client
from tracedb import build

from mcp_server.server import build_server

ORDER = ("get_time_breakdown", "get_causal_chains", "get_step_series", "get_stacks")


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, str]:
    p = tmp_path_factory.mktemp("prompt") / "h.duckdb"
    build("healthy", p)

    async def go():
        async with Client(build_server(p)) as c:
            prompt = await c.get_prompt("investigate", {"question": "Why is it slow?"})
            return {"prompt": prompt.messages[0].content.text, "instructions": c.instructions or ""}

    return anyio.run(go)


@pytest.mark.parametrize("which", ["prompt", "instructions"])
def test_the_order_is_breakdown_chains_steps_stacks(texts, which):
    text = texts[which]
    at = [text.index(name) for name in ORDER]
    assert at == sorted(at), dict(zip(ORDER, at, strict=True))


@pytest.mark.parametrize("which", ["prompt", "instructions"])
def test_each_step_says_what_its_tool_cannot_see(texts, which):
    # the text between one tool of the order and the next says what it cannot see
    text = " ".join(texts[which].split()).lower()
    at = [text.index(name) for name in ORDER] + [len(text)]
    for name, a, b in zip(ORDER, at, at[1:], strict=False):
        assert "cannot see" in text[a:b], name


def test_the_prompt_carries_the_question(texts):
    assert texts["prompt"].startswith("Why is it slow?")


def test_the_prompt_and_the_instructions_give_one_order(texts):
    # issue 31: the server held a 7-step and a 5-step copy that disagreed; both now give the whole order, once
    from mcp_server.guide import INVESTIGATION_ORDER

    for which in ("prompt", "instructions"):
        assert INVESTIGATION_ORDER in texts[which]
        assert texts[which].count("1. get_trace_stats") == 1
    assert "get_thread_dump" in INVESTIGATION_ORDER and "root" in INVESTIGATION_ORDER
