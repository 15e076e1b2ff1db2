"""ringflow.integrations.vllm: the vLLM plugin and its hooks (README, "Using ringflow with vLLM")."""
