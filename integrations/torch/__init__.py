"""Engine-neutral adapters over a stack of layers: the layer boundary ops that carry a plan through
``torch.compile``, weight streaming, full-KV prefetch and its verification. They take modules,
caches and callables, never an engine: the vLLM room (``integrations/vllm``) feeds them."""
