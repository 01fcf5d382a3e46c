"""Trace replay benchmark: our router's policies side by side with vllm-router and
sglang-router, live (real processes) or simulated (virtual clock); see README.md."""
