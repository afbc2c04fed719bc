"""Did the fix work? Two recordings of one workload compared (BEFORE, AFTER): steps/s, where the training
thread's time went, per-op rates and latency, and the causal chains that appeared, went away or changed, each
difference judged against the recordings' own variance.

What is compared, and from where:
- **The training loop.** Each recording's training thread and its *steps* (first launch or sync to the end of
  the last) come from the chains' context (:class:`tracer.analysis.chains.ChainContext`), so set-up (imports,
  attaching, forking the loader) counts on neither side. Its parts are the breakdown's
  (:mod:`tracer.analysis.breakdown`) over the loop's whole seconds (an edge second's row also holds time from
  before or after the loop), the seconds the noise tests sample.
- **Steps.** A step ends where the training thread waits for the GPU (the catalog's ``waits_for_gpu`` calls):
  the marker is the wait it makes most often. When both sides queue the same number of launches per marker,
  steps/s is the markers' rate. When one side waits k times less often (a fix that reads the loss every k steps)
  or not at all, a step is the launches between two waits of the side that waits most often. Otherwise
  (launches per step changed: fused kernels, CUDA graphs) the rates are shown, marked not comparable.
  ``steps.method`` says which held. Issue 20: a side that waits is counted from its waits (exact: their probes
  are never duty-cycled; 1 step, or k, per wait), each period between two waits shared among the seconds it
  spans; only a side that never waits is counted from its launches, its level op_stats' scaled count and its
  per-second shape the launches seen in each second over the share of it the probes were live.
  ``steps.before/after.counted_from`` says which.
- **Ops.** Calls, total time and p50/p99 per (op, layer) over every pid are :func:`tracer.analysis.stats.op_stats`
  (exact, from the in-kernel histograms); rates are per second of the training loop's span.
- **Chains.** Recomputed on both sides by the chains package (as ``tracer chains`` does; a stored
  ``causal_chains`` row may come from an older tracer), then paired by (category, culprit kind, relation, name):
  pids and Python lines change between two runs and between two versions of the code.

Noise. Every per-second quantity (steps, each part's share, each op's calls and time) is a sample of the
recording's own seconds: the difference of the two means gets a percentile bootstrap interval (seconds merged
into at most MAX_BLOCKS consecutive blocks, whose means absorb short-range correlation; RESAMPLES resamples,
seeded, so a comparison always gives the same answer), at a Bonferroni level over every test the comparison makes
(family-wise ALPHA). A latency quantile gets the distribution-free order-statistic interval of its exact
histogram, widened to bucket edges; two quantiles differ when their intervals do not overlap. Duty-cycled counts
(``op_stats.sampled_fraction`` < 1) widen their intervals by ``error_pct``; steps counted from duty-cycled
launches add that bound (about two standard errors, scaled to the test's level) in quadrature, and say so when it
is most of the interval. A difference is *beyond noise* when
its interval excludes zero and it is large enough to matter (MIN_SHARE_DELTA of the thread's time,
MIN_REL_DELTA of a rate or latency); *too_short* when a side has fewer than MIN_SECONDS whole seconds of loop.

Modules: ``model`` (the records), ``load`` (one side, loaded once), ``statistics`` (the noise tests), ``steps``,
``training``, ``ops``, ``chains``, ``warnings``, ``text`` (the headline), ``comparison`` (the entry point).
"""

from __future__ import annotations

from tracer.analysis.compare.comparison import compare_traces, names_of
from tracer.analysis.compare.load import MIN_SECONDS
from tracer.analysis.compare.model import (
    ChainChange,
    CompareWarning,
    Comparison,
    Noise,
    OpDelta,
    PartDelta,
    RecordingRef,
    StepsCompare,
    StepSide,
    TrainingCompare,
)
from tracer.analysis.compare.statistics import NOISE_TEST, mean_diff_interval

__all__ = [
    "MIN_SECONDS",
    "NOISE_TEST",
    "ChainChange",
    "CompareWarning",
    "Comparison",
    "Noise",
    "OpDelta",
    "PartDelta",
    "RecordingRef",
    "StepSide",
    "StepsCompare",
    "TrainingCompare",
    "compare_traces",
    "mean_diff_interval",
    "names_of",
]
