"""ringflow.kernels: gather implementations (leaves; they reach a plan as callables)."""

from ringflow.kernels.gathers import copy_host_to_device, index_gather, paged_gather

__all__ = ["copy_host_to_device", "index_gather", "paged_gather"]
