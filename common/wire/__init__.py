"""Bytes on the link: wire formats and their quantization, activation chunks, KV blocks (identity, layout,
one block's encoding), the Merkle tree over their leaves, and the messages of the Generate stream."""
