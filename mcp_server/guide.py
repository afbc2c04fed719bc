"""What the assistant reads besides the tools' own descriptions: the server's instructions, the ``investigate``
prompt and the ``trace://schema`` resource. The investigation order is written once (:data:`INVESTIGATION_ORDER`)
and both the instructions and the prompt give it whole.
"""

from __future__ import annotations

from tracer.schema import schema_markdown

# The investigation order, written once (issue 31): the server's instructions and the `investigate` prompt both
# give it, so an assistant meets one order whichever it reads.
INVESTIGATION_ORDER = """\
1. get_trace_stats: environment, per-op p50/p99 and tail ratio, processes, busy threads, host peaks, chain counts.
2. get_time_breakdown: where the training thread's time went (on CPU, in CUDA calls by class, waiting for a CPU
   and who held it, blocked and who woke it, page faults), per time bucket; the tracer's own cost. Cannot see
   what the GPU did (kernel time on the device) nor which code ran while the thread was on CPU.
3. get_causal_chains: diagnoses worst first, ranked by the share of the training thread's time each cost, with
   the culprit (process, thread, Python line), the wait path followed from the thread to its root (a line on
   CPU, an external wait, CPU capacity, placement, the interpreter's collector, the GPU), evidence and fixes.
   Filter with pid/severity. Cannot see a cause no root explains: coverage gives the share of the lost time
   whose root was found, and what is left is yours to explain. A distributed job (torchrun, MPI ranks):
   get_ranks gives each rank's time by phase and the straggler rank.
4. get_step_series: the training thread's steps (ended by its waits for the GPU), the slow ones and their period
   ("every 40th step: +54 ms") with what they spent the extra time on; get_waits: its waits by waker and length
   ("[timer], 5.1 ms each"); compare_processes: processes or threads side by side. Cannot see steps of a loop
   that never waits for the GPU (it gets a per-second series) nor which code ran in a slow step.
5. get_stacks(op): for the op a chain names, the code paths from the Python file:line to the CUDA call; coverage
   says why calls have no stack. Cannot see code outside CUDA calls (CPU work, waits): get_thread_stacks does,
   on CPU (sampled) or blocked (exact, classified gil | lock | io | sleep | cuda | other), per thread; and
   get_thread_dump says what each thread was doing at its latest snapshot, even one blocked since before the
   recording began.
6. compare_traces(before=FILE): did a change work? This recording against another of the same workload
   (a .duckdb file next to it): steps/s, the training thread's parts, per-op deltas, chains gained or lost,
   each judged against the recordings' own noise.
7. run_sql: anything else (time buckets, the microsecond timeline around a stall, per-PID scheduling).
   Read the trace://schema resource first. Timestamps are ns since session start; ts_ns // 10000000000 buckets
   by 10 s."""

INSTRUCTIONS = f"""\
You are investigating one recording of a GPU training job: every CUDA API call with its latency, what the
calling thread did during it (off CPU, waiting for a CPU, who preempted it), the process tree, and host samples.
Investigation order (each step says what its tool cannot see):
{INVESTIGATION_ORDER}
Quote the numbers the tools return; op_stats counts are exact, cuda_calls rows are a sample that keeps the tail."""


INVESTIGATE_STEPS = f"""\
Use the cuda-host-tracer tools in this order, and before concluding, say what each could not see:
{INVESTIGATION_ORDER}
Answer with the measured numbers (step ms, shares, p50/p99, who woke or preempted the thread, Python file:line)
and the recommended fixes, most effective first, each from the root of its chain's path."""


def investigate(question: str = "How did my last training go, and how do I make it faster?") -> str:
    """Walk through the trace in the recommended order and answer the engineer's question."""
    return f"{question}\n\n{INVESTIGATE_STEPS}"


def schema() -> str:
    """Every table and column of the trace DB with its meaning and units, plus example queries."""
    return schema_markdown()
