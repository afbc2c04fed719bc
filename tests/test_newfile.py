"""tracer/newfile.py: the one check of a file about to be created, for an export's -o and the recorder's --db."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from tracer.errors import StoreError, UsageError
from tracer.newfile import check_new_file


def test_a_new_file_in_an_existing_directory_is_accepted(tmp_path):
    check_new_file(tmp_path / "new.json", force=False)


@pytest.mark.parametrize(("option", "error"), [("-o", UsageError), ("--db", StoreError)])
def test_a_directory_a_missing_parent_and_an_existing_file_are_refused_each_with_a_hint(tmp_path, option, error):
    (tmp_path / "old.json").write_text("{}")
    for path, says in (
        (tmp_path, "is a directory"),
        (tmp_path / "nowhere" / "x.json", "no directory"),
        (tmp_path / "old.json", "exists"),
    ):
        with pytest.raises(error, match=says) as e:
            check_new_file(path, False, option, error)
        assert option in e.value.hint  # the hint names the option to change
    check_new_file(tmp_path / "old.json", True, option, error)  # --force replaces a file, never a directory
    with pytest.raises(error, match="is a directory"):
        check_new_file(tmp_path, True, option, error)


def test_a_directory_the_user_may_not_write_into_is_refused():
    # GIVEN a directory of mode 555, and a child that drops root (root's access() ignores modes) to nobody
    ro = Path(tempfile.mkdtemp(prefix="newfile-ro-", dir="/tmp"))
    try:
        ro.chmod(0o555)
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                if os.geteuid() == 0:
                    os.setuid(65534)
                check_new_file(ro / "x.json", False)
            except UsageError as e:
                code = 0 if "cannot write to directory" in str(e) else 1
            except BaseException:  # noqa: BLE001 - any other outcome fails the test below
                code = 2
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        # THEN it is refused as unwritable, not as missing
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        ro.chmod(0o755)
        ro.rmdir()
