"""How a tool's record goes on the wire: as structured content (its schema is the record's) plus the same JSON,
compact, as text for models that read only text."""

from __future__ import annotations

import json

from mcp.types import CallToolResult, TextContent
from pydantic import BaseModel


def compact_reply(record: BaseModel) -> CallToolResult:
    """Return ``record`` as structured content plus the same JSON as compact text: the SDK's default text is
    indented, which made an answer a model reads in full a third longer."""
    data = record.model_dump(mode="json")
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return CallToolResult(content=[TextContent(type="text", text=text)], structured_content=data)
