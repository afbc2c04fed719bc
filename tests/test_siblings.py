"""tracer.analysis.db.siblings: the other recording compare_traces reads, named by bare file name in one directory.

A model names the file, so each way out of the directory is tried here (a path, a hidden file, another suffix, a
link out, a dangling link), and every refusal must list what can be named without naming the directory itself.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tracer.analysis.db.siblings import LIST_RECORDINGS, listing, sibling
from tracer.errors import UsageError


@pytest.fixture()
def here(tmp_path: Path) -> Path:
    d = tmp_path / "runs"
    d.mkdir()
    for name in ("after.duckdb", "before.duckdb", "notes.txt", ".hidden.duckdb"):
        (d / name).write_bytes(b"x")
    (tmp_path / "outside.duckdb").write_bytes(b"x")
    os.symlink(tmp_path / "outside.duckdb", d / "out.duckdb")  # leads out of the directory
    os.symlink(d / "notes.txt", d / "notes.duckdb")  # stays inside, but to a file not named .duckdb
    os.symlink(d / "gone.duckdb", d / "dangling.duckdb")
    os.symlink(d / "before.duckdb", d / "baseline.duckdb")  # a link to a recording beside it
    return d


def refusal(directory: Path, name: str) -> str:
    with pytest.raises(UsageError) as e:
        sibling(directory, name)
    text = f"{e.value.message} {e.value.hint}"
    assert str(directory) not in text and str(directory.resolve()) not in text  # never the server's path
    return e.value.message


def test_a_bare_name_is_the_file_beside_it(here: Path):
    assert sibling(here, "before.duckdb") == (here / "before.duckdb").resolve()


def test_a_link_inside_resolves_to_its_target(here: Path):
    # the checked target is returned, not the link: a link swapped after the check is not followed
    assert sibling(here, "baseline.duckdb") == (here / "before.duckdb").resolve()


@pytest.mark.parametrize(
    "name",
    ["../outside.duckdb", "/etc/passwd", "sub/after.duckdb", "a\\b.duckdb", "notes.txt", ".hidden.duckdb", ""],
)
def test_anything_but_a_bare_recording_name_is_refused(here: Path, name: str):
    msg = refusal(here, name)
    assert "is not a recording's file name" in msg
    assert msg.endswith("recordings here: after.duckdb, baseline.duckdb, before.duckdb")


def test_a_name_that_is_not_there_lists_the_recordings(here: Path):
    assert refusal(here, "nope.duckdb") == (
        "no recording 'nope.duckdb' here; recordings here: after.duckdb, baseline.duckdb, before.duckdb"
    )


@pytest.mark.parametrize("name", ["out.duckdb", "notes.duckdb"])
def test_a_link_out_or_to_another_kind_of_file_is_refused(here: Path, name: str):
    msg = refusal(here, name)
    assert "leads out of the served recording's directory" in msg
    assert name not in msg.split("recordings here:")[1]  # not offered as a name either


def test_a_dangling_link_is_no_recording(here: Path):
    assert "no recording 'dangling.duckdb' here" in refusal(here, "dangling.duckdb")


def test_a_huge_name_is_not_sent_back(here: Path):
    msg = refusal(here, "x" * 100_000 + ".duckdb")
    assert len(msg) < 400 and "(100,007 characters)" in msg


def test_the_listing_is_capped(tmp_path: Path):
    for i in range(LIST_RECORDINGS + 5):
        (tmp_path / f"r{i:02d}.duckdb").write_bytes(b"x")
    shown = listing(tmp_path)
    assert shown.startswith("r00.duckdb, r01.duckdb") and shown.endswith(f"… ({LIST_RECORDINGS + 5} in all)")
    assert shown.count(".duckdb") == LIST_RECORDINGS


def test_an_empty_or_unreadable_directory_lists_none(tmp_path: Path):
    assert listing(tmp_path) == "(none)"
    assert listing(tmp_path / "missing") == "(none)"
