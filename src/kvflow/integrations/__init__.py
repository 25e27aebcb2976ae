"""Other engines reading and writing the kvflow pool. ``vllm``: a vLLM v1 KV connector (docs/INTEGRATIONS.md).

Nothing here imports an engine at import time: kvflow's own tests and tools never need vLLM installed.
"""
