"""What the MCP tests share: the tool set the server registers, and waiting for a served process to answer."""

from __future__ import annotations

import subprocess
import time

import httpx

# every MCP tool the server registers (tests/test_mcp_server.py and the real-recording tests check the list)
TOOLS = frozenset(
    {
        "get_trace_stats",
        "get_causal_chains",
        "get_time_breakdown",
        "get_ranks",
        "get_stacks",
        "get_thread_stacks",
        "get_thread_dump",
        "get_step_series",
        "get_waits",
        "compare_processes",
        "run_sql",
        "compare_traces",
    }
)


def wait_healthy(proc: subprocess.Popen[bytes], base: str, timeout_s: float = 60) -> None:
    """Wait until the server at ``base`` answers /healthz; fail with its stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        try:
            if httpx.get(f"{base}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.1)
