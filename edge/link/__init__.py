"""The edge's link to its cloud: the seam and its gRPC transport, the connection and its negotiation,
replicas and their discovery, the uplink and its framing, the downlink of remote prefill's KV, and the
session sync."""
