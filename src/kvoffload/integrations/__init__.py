"""Engine integrations.

Each subpackage imports its engine and is loaded only by that engine (vLLM
finds ``kvoffload.integrations.vllm`` through ``kv_connector_module_path``),
so importing :mod:`kvoffload` never pulls an inference engine in.
"""
