"""Session state the cloud keeps between turns: the table, its store beside the KV blocks, and which state a
turn or a SyncSession call finds."""
