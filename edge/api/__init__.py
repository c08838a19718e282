"""The edge's client APIs: the OpenAI-compatible HTTP API and the gRPC Edge service, with their requests,
responses, errors and events."""
