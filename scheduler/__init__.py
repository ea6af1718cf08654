"""Requests, the scheduling policy, and the StepPlan the workers execute.

Pure Python on top of kvcache/ (no torch). Workers import only `scheduler.plan` and
`scheduler.sampling_params`.
"""

from scheduler.config import SchedulerConfig
from scheduler.outputs import (
    CompletionOutput,
    Logprob,
    QueueLoad,
    RequestOutput,
    SchedulerStats,
    StepOutcome,
)
from scheduler.plan import NewSeq, PromptLogprobs, StepPlan, StepResult
from scheduler.request import Request, RequestStatus, Seq, SequenceStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CompletionOutput",
    "Logprob",
    "NewSeq",
    "PromptLogprobs",
    "QueueLoad",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Seq",
    "SequenceStatus",
    "StepOutcome",
    "StepPlan",
    "StepResult",
    "StructuredOutputsParams",
]
