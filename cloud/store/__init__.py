"""The cloud's KV block store: the interface and its in-memory form, one node's disk store, and the Redis
store replicas share."""
