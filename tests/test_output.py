"""tracer/views/output.py: refusing to write over existing output files."""

from __future__ import annotations

import pytest

from tracer.errors import UsageError
from tracer.views.output import refuse_existing


def test_several_existing_files_are_named_together(tmp_path):
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    a.write_text("")
    b.write_text("")
    with pytest.raises(UsageError, match=f"{a}, {b} exist$"):
        refuse_existing([a, b, c], force=False)
    refuse_existing([a, b, c], force=True)
