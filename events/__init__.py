"""The wire: vLLM-compatible KV cache events, block hashing, ZMQ transport, hybrid hit rule.

Imports nothing from ``router`` or ``engine_adapter``.
"""
