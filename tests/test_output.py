"""tracer/views/output.py: the one check of an output file (export, flame, export --per-rank, the Parquet host)."""

from __future__ import annotations

import pytest

from tracer.errors import UsageError
from tracer.views.output import check_output_file, refuse_existing


def test_a_new_file_in_an_existing_directory_is_accepted(tmp_path):
    check_output_file(tmp_path / "new.json", force=False)


def test_a_directory_a_missing_parent_and_an_existing_file_are_refused_each_with_a_hint(tmp_path):
    (tmp_path / "old.json").write_text("{}")
    for path, says in (
        (tmp_path, "is a directory"),
        (tmp_path / "nowhere" / "x.json", "no directory"),
        (tmp_path / "old.json", "exists"),
    ):
        with pytest.raises(UsageError, match=says) as e:
            check_output_file(path, force=False)
        assert e.value.hint
    check_output_file(tmp_path / "old.json", force=True)  # --force replaces a file, never a directory
    with pytest.raises(UsageError, match="is a directory"):
        check_output_file(tmp_path, force=True)


def test_several_existing_files_are_named_together(tmp_path):
    a, b, c = (tmp_path / n for n in ("a", "b", "c"))
    a.write_text("")
    b.write_text("")
    with pytest.raises(UsageError, match=f"{a}, {b} exist$"):
        refuse_existing([a, b, c], force=False)
    refuse_existing([a, b, c], force=True)
