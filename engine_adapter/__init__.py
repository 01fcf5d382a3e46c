"""Engine side: hybrid GPU block pool, CPU offload tier and a simulated OpenAI engine."""
