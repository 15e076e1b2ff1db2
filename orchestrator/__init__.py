"""ringflow.orchestrator: profiles, slot pools and leases, the Dag, the Planner, the hazard proof.

The bottom layer: it imports none of the others, and only ``slots`` (which allocates) needs
torch (``tests/unit/test_import_layers.py``).
"""
