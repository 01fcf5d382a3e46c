"""The routing decision: tokenize, hash the prompt, score each instance, rank by policy."""
