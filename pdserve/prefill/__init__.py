"""Prefill engines behind one interface: `reference` (torch) now, `vllm` (stock vLLM) later."""
