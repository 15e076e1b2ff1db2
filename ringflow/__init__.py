"""ringflow: plan, prove and run per-layer prefetch (gather on a side stream while a layer
computes) over a bounded ring of preallocated workspace slots.

The public API is what this module exports; everything else is an implementation detail.

Note [Lazy public API]
    Every subpackage imports ``ringflow.errors``, which runs this file first. So this file
    imports nothing: a name in ``__all__`` is loaded from its module the first time it is
    asked for (``from ringflow import Planner``), and importing the orchestrator (pure Python)
    never drags in torch or the executors. Imports run one way (ARCHITECTURE.md, "Rooms"):
    integrations/vllm -> integrations/torch -> graphs -> orchestrator; kernels are leaves; the
    root's own modules (errors, envs, units, cudart, timing) are below them all.
    ``tests/unit/test_import_layers.py`` checks every module in fresh interpreters.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS = {
    **dict.fromkeys(["AllocationError", "BudgetError", "CaptureError", "ConfigError",
                     "DeviceError", "EngineError", "ExecutorError", "HazardError", "KernelError",
                     "LeaseError", "LifecycleError", "MeasurementError", "OutputError",
                     "PlanError", "ProfileError", "RingflowError", "SlotPoolExhausted",
                     "UnsupportedModelError"], "ringflow.errors"),
    "CapturedExecutor": "ringflow.graphs.captured",
    "EagerExecutor": "ringflow.graphs.eager",
    "SyncExecutor": "ringflow.graphs.sync",
    "PoolLayout": "ringflow.orchestrator.budget",
    **dict.fromkeys(["Dag", "EventRole", "Node", "NodeKind"], "ringflow.orchestrator.dag"),
    **dict.fromkeys(["from_json", "to_dot", "to_json", "to_text"], "ringflow.orchestrator.dumps"),
    "check_hazards": "ringflow.orchestrator.hazards",
    "Planner": "ringflow.orchestrator.planner",
    **dict.fromkeys(["Profile", "load_profile"], "ringflow.orchestrator.profile"),
    **dict.fromkeys(["Lease", "LeaseState", "SlotPool"], "ringflow.graphs.slots"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ringflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # the next lookup is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})

