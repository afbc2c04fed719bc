"""The comparison's records: what ``tracer compare`` prints, ``--json`` dumps and the MCP tool ``compare_traces``
returns (one model, so the three cannot disagree)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from tracer.analysis import Record
from tracer.analysis.taxonomy import PART_NAMES

Verdict = Literal["beyond_noise", "within_noise", "too_short", "not_tested"]
Presence = Literal["both", "before_only", "after_only"]
ChainStatus = Literal["appeared", "gone", "worse", "better", "unchanged"]
StepCount = Literal["waits", "launches", "none"]


class Noise(Record):
    """Whether a difference is beyond the recordings' own variance, and its interval."""

    verdict: Annotated[
        Verdict,
        Field(
            description="beyond_noise (interval excludes 0 and the change is large enough to matter) | "
            "within_noise | too_short (a side has too few seconds or calls to tell) | not_tested"
        ),
    ]
    ci_lo: Annotated[float | None, Field(description="lower end of the difference's interval (the delta's unit)")]
    ci_hi: Annotated[float | None, Field(description="upper end")]
    note: str = ""


class RecordingRef(Record):
    """One side of the comparison."""

    name: Annotated[str, Field(description="the recording's file, as named")]
    target: Annotated[str, Field(description="session.target: the command, or pid N")]
    started_at: str
    duration_s: float
    status: str
    basis: Annotated[str, Field(description="exact (thread_breakdown) | estimated (older recording) | none")]
    training_pid: int | None
    training_tid: int | None
    training_comm: str
    loop_start_s: Annotated[float, Field(description="the training loop's first launch or sync, s since start")]
    loop_s: Annotated[float, Field(description="length of the training loop (its steps), s: the rates' denominator")]
    seconds: Annotated[int, Field(description="whole seconds of loop: the samples of the per-second noise tests")]


class StepSide(Record):
    """Steps of one recording."""

    steps: Annotated[
        float | None, Field(description="steps in the loop (waits x steps per wait, or launches / step size)")
    ]
    steps_per_s: Annotated[
        float | None,
        Field(description="steps per second: over the whole periods between waits when counted from waits"),
    ]
    counted_from: Annotated[
        StepCount,
        Field(
            description="waits: exact calls of the marker x steps_per_wait (waits are never duty-cycled) | "
            "launches: launches / launches_per_step, scaled per second when duty-cycled | none"
        ),
    ]
    steps_per_wait: Annotated[int | None, Field(description="steps between two waits, when counted from waits")]
    steps_error_pct: Annotated[
        float, Field(description="bound on steps/s' error from the launch sampler, % (0: counted from exact calls)")
    ]
    marker: Annotated[str | None, Field(description="the training thread's most frequent wait for the GPU")]
    waits_per_step: Annotated[
        int, Field(description="the marker's calls in one step (tracer.analysis.steps: the one definition)")
    ] = 1
    markers: Annotated[
        float, Field(description="steps the marker ended on the training thread: its calls / waits_per_step")
    ]
    launches: Annotated[float, Field(description="kernel launches of the training thread (scaled when duty-cycled)")]
    launches_per_marker: float | None
    launch_error_pct: Annotated[float, Field(description="bound on the launch count's error, % (0: exact)")]


class StepsCompare(Record):
    """Steps/s before and after, when a step can be seen."""

    detected: bool
    comparable: Annotated[bool, Field(description="both sides count the same unit of work as a step")]
    method: Annotated[str, Field(description="how a step was detected, in words (or why none could be)")]
    launches_per_step: Annotated[float | None, Field(description="launches in one step, when steps are counted so")]
    before: StepSide
    after: StepSide
    delta_per_s: float | None
    delta_pct: float | None
    noise: Noise


class PartDelta(Record):
    """One part of the training thread's time, before and after, over its loop's whole seconds."""

    part: Annotated[str, Field(description=" | ".join(PART_NAMES))]
    before_ms: float
    after_ms: float
    before_share: Annotated[float, Field(description="share of the thread's steps' time, 0..1")]
    after_share: float
    delta_points: Annotated[float, Field(description="after - before share, in percentage points")]
    before_ms_per_step: Annotated[float | None, Field(description="share x step time (when steps are comparable)")]
    after_ms_per_step: float | None
    noise: Annotated[Noise, Field(description="on the per-second shares; ci in percentage points")]


class TrainingCompare(Record):
    """The training thread's time breakdown before and after, parts that changed most first: over the whole
    seconds of its loop (an edge second also holds time from before or after the loop), or over the whole loop
    when it is too short to test."""

    before_wall_ms: Annotated[float, Field(description="the thread's time the parts split, ms")]
    after_wall_ms: float
    parts: list[PartDelta]


class OpDelta(Record):
    """One CUDA op (per layer, every pid) before and after: exact counts and latency from op_stats."""

    op: str
    layer: str
    part: Annotated[str, Field(description="launch | sync | alloc | free | copy | other (probe catalog)")]
    presence: Annotated[Presence, Field(description="both | before_only | after_only")]
    calls_before: int
    calls_after: int
    calls_per_s_before: Annotated[float, Field(description="calls per second of the training loop")]
    calls_per_s_after: float
    calls_delta_pct: Annotated[float | None, Field(description="change of calls/s, % (null when it had none)")]
    total_ms_before: float
    total_ms_after: float
    ms_per_s_before: Annotated[float, Field(description="time in the op per second of loop, ms/s")]
    ms_per_s_after: float
    p50_us_before: float | None
    p50_us_after: float | None
    p99_us_before: float | None
    p99_us_after: float | None
    error_pct_before: Annotated[float, Field(description="count error bound when duty-cycled, % (0: exact)")]
    error_pct_after: float
    rate_noise: Annotated[Noise, Field(description="calls/s; ci in calls/s")]
    time_noise: Annotated[Noise, Field(description="ms/s; ci in ms/s")]
    p50_noise: Annotated[Noise, Field(description="ci of after - before, µs")]
    p99_noise: Noise


class ChainChange(Record):
    """A causal chain that appeared, went away, or changed (paired by category and culprit)."""

    category: str
    status: Annotated[ChainStatus, Field(description="appeared | gone | worse | better | unchanged")]
    severity_before: str | None
    severity_after: str | None
    share_before: Annotated[float | None, Field(description="share of the training thread's steps it cost, 0..1")]
    share_after: float | None
    culprit: Annotated[str, Field(description="who or what it blames: comm, relation, code site")]
    op: str
    summary: Annotated[str, Field(description="the chain's summary, from the side that has it (after when both)")]
    note: str = ""


class CompareWarning(Record):
    """Something that makes the comparison less trustworthy, or worth knowing."""

    level: Annotated[Literal["warning", "info"], Field(description="warning | info")]
    kind: Annotated[
        str,
        Field(
            description="different_program | different_workload | different_host | different_options | "
            "different_basis | unfinished | too_short | steps | same_file | arguments | tracer_version"
        ),
    ]
    message: str


class Comparison(Record):
    """Two recordings of one workload compared: the headline, steps/s, the training thread's time, per-op
    deltas and chains, each difference judged against the recordings' own variance."""

    before: RecordingRef
    after: RecordingRef
    headline: Annotated[list[str], Field(description="the differences beyond noise, most important first")]
    noise_test: Annotated[str, Field(description="how noise is judged (the tests, their level)")]
    alpha: Annotated[float, Field(description="family-wise error rate over all the tests")]
    tests: Annotated[int, Field(description="tests made (the Bonferroni divisor)")]
    steps: StepsCompare
    training: Annotated[TrainingCompare | None, Field(description="null when a side has no CUDA thread")]
    ops: Annotated[list[OpDelta], Field(description="every op, largest change of time per second first")]
    chains: Annotated[list[ChainChange], Field(description="changed chains first, worst first")]
    warnings: list[CompareWarning]
