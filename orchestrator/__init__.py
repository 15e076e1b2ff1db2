"""ringflow.orchestrator: plan and prove. The profile (schema, sections, vocabulary), the budget
arithmetic, the Dag, the Planner, the hazard proof, the simulator and the dumps.

Pure Python over names and numbers: it imports no other room of ringflow and no torch
(``tests/unit/test_import_layers.py``), so ``ringflow plan`` runs anywhere.
"""
