"""How a turn is served once routed: split and direct through the cloud, local on this edge, and remote
prefill."""
