"""ringflow.integrations: engine-neutral adapters over a stack of layers (``torch``) and the shim
that plugs them into vLLM (``vllm``)."""
