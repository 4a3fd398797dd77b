"""The vLLM tier: vLLM's real v1 scheduler on CPU, driving the kvoffload connector."""
