"""End-to-end proof harness: a CPU stand-in for vLLM's GPU model runner, tests over it."""
