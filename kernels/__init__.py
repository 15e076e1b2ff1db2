"""ringflow.kernels: gather implementations (leaves; they reach a plan as callables)."""

from ringflow.kernels.gathers import copy_host_to_device, index_gather, paged_gather
from ringflow.kernels.kv_gathers import (dcp_all_gather, dcp_gather, dcp_local_lens,
                                         dcp_slot_rows, dcp_slot_starts, page_gather)

__all__ = ["copy_host_to_device", "dcp_all_gather", "dcp_gather", "dcp_local_lens",
           "dcp_slot_rows", "dcp_slot_starts", "index_gather", "page_gather", "paged_gather"]
