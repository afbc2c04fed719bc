"""Thread roles under a launcher (issue 23): with several ranks each rank's training thread is a ``training``
thread (its driver thread, or its main thread when it makes no CUDA call), not one rank's "training" and the
others' "driver"; the launcher is a ``launcher``. Checked on the hand-built 3-rank torchrun job of
tests/test_ranks.py, in the breakdown, compare_processes and the thread times they share."""

from __future__ import annotations

from tests.test_ranks import AGENT, COMM_TID, RANK_PIDS, job
from tracer.analysis.breakdown import load_thread_times, time_breakdown
from tracer.analysis.db import open_trace
from tracer.analysis.recording import load_recording
from tracer.analysis.side_by_side import compare_processes
from tracer.vocabulary import LAUNCHER_ROLE, PLAIN_THREAD, RANK_ROLE, TRAINING_THREAD


def _db(tmp_path, cuda: bool = True):
    b = job(steps=60)
    if not cuda:  # ranks training on the CPU: the same loop with no CUDA call
        b.cuda_calls = []
    p = tmp_path / "ranks.duckdb"
    b.write(p)
    return p


def test_every_rank_main_thread_trains_in_the_breakdown(tmp_path):
    with open_trace(_db(tmp_path)) as c:
        res = time_breakdown(c)
        info = load_recording(c)
    # GIVEN 3 ranks whose main threads issue the CUDA calls  THEN each one is a training thread, none a "driver"
    roles = {t.tid: t.role for t in res.threads}
    assert roles == dict.fromkeys(RANK_PIDS, TRAINING_THREAD)
    assert res.training_tid in RANK_PIDS
    # AND the launcher is a launcher, the ranks ranks
    assert info.process_role(AGENT) == LAUNCHER_ROLE
    assert {info.process_role(p) for p in RANK_PIDS} == {RANK_ROLE}


def test_every_rank_column_is_a_training_thread(tmp_path):
    with open_trace(_db(tmp_path)) as c:
        res = compare_processes(c)
    # THEN compare_processes shows each rank by its main thread, a training thread
    assert [(col.pid, col.tid, col.rank, col.role, col.thread_role) for col in res.columns] == [
        (p, p, r, RANK_ROLE, TRAINING_THREAD) for r, p in enumerate(RANK_PIDS)
    ]


def test_ranks_with_no_cuda_call_train_on_their_main_thread(tmp_path):
    # GIVEN the ranks training on the CPU (their gloo threads are busier than their main threads)
    with open_trace(_db(tmp_path, cuda=False)) as c:
        times = load_thread_times(c)
        cols = compare_processes(c).columns
        one = time_breakdown(c, tid=RANK_PIDS[2]).threads
    # THEN each rank's main thread is a training thread and its gloo thread a plain thread
    assert times.training is None and times.rank_pids == frozenset(RANK_PIDS)
    for p in RANK_PIDS:
        main, gloo = times.by_tid(p), times.by_tid(p + COMM_TID)
        assert main is not None and gloo is not None
        assert (times.role_of(main), times.role_of(gloo)) == (TRAINING_THREAD, PLAIN_THREAD)
        assert times.rank_thread(p) is main
    # AND compare_processes shows each rank by that thread, the breakdown of one names it so
    assert [(col.tid, col.thread_role) for col in cols] == [(p, TRAINING_THREAD) for p in RANK_PIDS]
    assert [(t.tid, t.role) for t in one] == [(RANK_PIDS[2], TRAINING_THREAD)]
