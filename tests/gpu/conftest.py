"""Fixtures shared by the GPU test modules (the vLLM ones: vllm_fixtures.py)."""
from vllm_fixtures import tiny_dir  # noqa: F401  (module-scoped: one export per test module)
