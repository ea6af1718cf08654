"""Requests, the scheduling policy, and the StepPlan the workers execute.

Pure Python on top of kvcache/ (no torch). Workers import only `scheduler.plan` and
`scheduler.sampling_params`.
"""

from scheduler.config import SchedulerConfig
from scheduler.detokenizer import IncrementalDetokenizer, StopStringBuffer
from scheduler.outputs import CompletionOutput, RequestOutput, SchedulerStats
from scheduler.plan import NewSeq, StepPlan, StepResult
from scheduler.request import Request, RequestStatus, Sequence, SequenceStatus
from scheduler.sampling_params import SamplingParams, StructuredOutputsParams
from scheduler.scheduler import Scheduler

__all__ = [
    "CompletionOutput",
    "IncrementalDetokenizer",
    "NewSeq",
    "Request",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "Sequence",
    "SequenceStatus",
    "StepPlan",
    "StepResult",
    "StopStringBuffer",
    "StructuredOutputsParams",
]
