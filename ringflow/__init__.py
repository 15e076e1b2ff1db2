"""ringflow: plan, prove and run per-layer prefetch (gather on a side stream while a layer
computes) over a bounded ring of preallocated workspace slots.

The public API is what this module exports; everything else is an implementation detail.
"""

from ringflow.errors import (
    CaptureError,
    ExecutorError,
    HazardError,
    KernelError,
    LeaseError,
    LifecycleError,
    PlanError,
    ProfileError,
    RingflowError,
    SlotPoolExhausted,
)
from ringflow.graphs.captured import CapturedExecutor
from ringflow.graphs.eager import EagerExecutor
from ringflow.graphs.sync import SyncExecutor
from ringflow.orchestrator.budget import PoolLayout
from ringflow.orchestrator.dag import Dag, EventRole, Node, NodeKind
from ringflow.orchestrator.dumps import from_json, to_dot, to_json, to_text
from ringflow.orchestrator.hazards import check_hazards
from ringflow.orchestrator.planner import Planner
from ringflow.orchestrator.profile import Profile, load_profile
from ringflow.orchestrator.slots import Lease, LeaseState, SlotPool

__version__ = "0.1.0"

__all__ = [
    "CaptureError", "CapturedExecutor", "Dag", "EagerExecutor", "EventRole", "ExecutorError", "HazardError",
    "KernelError", "Lease", "LeaseError", "LifecycleError", "LeaseState", "Node", "NodeKind", "PlanError",
    "Planner", "PoolLayout", "Profile", "ProfileError", "RingflowError", "SlotPool",
    "SlotPoolExhausted", "SyncExecutor", "check_hazards", "from_json", "load_profile", "to_dot",
    "to_json", "to_text",
]
