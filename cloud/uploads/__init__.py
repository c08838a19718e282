"""A split turn's upload: checked piece by piece, received into the block store, bounded in flight,
resumable when cut, and its blocks pinned until decode."""
