"""The cloud's vLLM engines: the two ``AsyncLLM`` engines and their in-memory double, their start,
supervision and clean-up, tandem's KV connector and its per-request parameters, the KV layout adapters,
and vLLM's plugin and metrics."""
