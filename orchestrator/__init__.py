"""ringflow.orchestrator: profiles, slot pools and leases, the Dag, the Planner, the hazard proof."""
