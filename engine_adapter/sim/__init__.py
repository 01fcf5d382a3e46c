"""A simulated OpenAI-compatible engine built on the hybrid block pool (no GPU needed)."""
