"""Helpers of the test suite (not of ringflow): executor mutants, the vLLM end-to-end runner
and the replay checker, each run or imported by the tests (``tests/`` is on ``sys.path``)."""
