"""ringflow.integrations.vllm: the vLLM plugin (see the README section "Using ringflow with vLLM")."""
