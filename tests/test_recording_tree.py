"""RecordingInfo's process-tree look-ups that the chains use on fork-heavy recordings (issue 28's cost): a
process's ancestry walked up from it (descends_from) agrees with the tree walked down (descendants), and the
DataLoader workers found once (dataloader_pids) are the processes whose role is dataloader_worker."""

from __future__ import annotations

from tracer.analysis.recording import Proc, ProcTable, RecordingInfo
from tracer.vocabulary import DATALOADER_COMM, DATALOADER_ROLE, TRACER_ROLE


def _info(rows: list[tuple[int, int | None, str, str]]) -> RecordingInfo:
    info = RecordingInfo(columns={})
    info.procs = ProcTable.of(Proc(pid, ppid, comm, role, 0, None, None) for pid, ppid, comm, role in rows)
    return info


# 1 -> 2 -> 3 -> 4; 1 -> 5; 6's parent 99 is not recorded (so 7, its child, hangs off nothing known);
# 8 and 9 are each other's parent (a pid reused: a loop); 10 is its own parent
TREE = [
    (1, None, "python", "target"),
    (2, 1, DATALOADER_COMM, "target"),
    (3, 2, "bash", "target"),
    (4, 3, DATALOADER_COMM, "target"),
    (5, 1, DATALOADER_COMM, "tracer"),
    (6, 99, DATALOADER_COMM, "target"),
    (7, 6, "true", "target"),
    (8, 9, "a", "target"),
    (9, 8, "b", "target"),
    (10, 10, "c", "target"),
]


def test_descends_from_agrees_with_descendants_on_every_pair():
    info = _info(TREE)
    pids = [*info.procs, 99, 1000]
    for anc in pids:
        down = {p.pid for p in info.descendants(anc)}
        # GIVEN any two pids (unknown ones, loops and self-parents included)  THEN walking up from one finds the
        # other exactly when walking down from the other finds the one
        assert {p for p in pids if info.descends_from(p, anc)} == down, anc
    # a few by hand, so the agreement is not of two wrong walks
    assert info.descends_from(4, 1) and info.descends_from(7, 99) and not info.descends_from(1, 1)
    assert not info.descends_from(8, 1) and info.descends_from(8, 9) and not info.descends_from(10, 10)


def test_dataloader_pids_are_the_processes_with_the_worker_role():
    info = _info(TREE)
    info.main_pid = 1
    # GIVEN processes named as workers, one of them the tracer's  THEN only the target's named ones are workers
    assert info.dataloader_pids == {p for p in info.procs if info.process_role(p) == DATALOADER_ROLE}
    assert info.dataloader_pids == {2, 4, 6}
    assert info.process_role(5) == TRACER_ROLE
