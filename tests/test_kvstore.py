"""Unit tests: KV block identity, canonical blocks and the bounded block stores."""

import multiprocessing as mp

import numpy as np
import pytest

from tandem.common.kvblocks import LayerRange, block_hashes, hash_seed, part_key, split_blocks
from tandem.common.kvstore import DiskBlockStore, MemoryBlockStore


def test_chained_hashes_share_prefixes():
    seed = hash_seed("m", 4)
    a = block_hashes(list(range(10)), 4, seed)
    b = block_hashes(list(range(8)) + [99, 100, 101, 102], 4, seed)
    assert len(a) == 2 and len(b) == 3
    assert a == b[:2]
    assert block_hashes([1, 0, 2, 3, 4, 5, 6, 7], 4, seed)[1] != a[1]  # a change earlier changes later ids
    assert block_hashes(list(range(8)), 4, hash_seed("other", 4)) != a


def test_split_blocks_shapes():
    kv = np.arange(2 * 2 * 3 * 10 * 4, dtype=np.float32).reshape(2, 2, 3, 10, 4)
    blocks = split_blocks(kv, 4, 1, 2)
    assert len(blocks) == 1 and blocks[0].shape == (2, 2, 3, 4, 4)
    assert np.array_equal(blocks[0], kv[:, :, :, 4:8])
    with pytest.raises(ValueError):
        split_blocks(kv, 4, 0, 3)
    with pytest.raises(ValueError):
        LayerRange(3, 3)


def test_memory_store_is_bounded_lru():
    s = MemoryBlockStore(size_limit_bytes=10)
    s.put("a", b"1234")
    s.put("b", b"1234")
    assert s.get("a") == b"1234"  # a is now most recent
    s.put("c", b"1234")  # evicts b
    assert s.contains("a") and s.contains("c") and not s.contains("b")


def _writer(directory, n):
    st = DiskBlockStore(directory, 1 << 26)
    for i in range(n):
        st.put(f"k{i}", bytes([i % 256]) * 1000)


def test_disk_store_across_processes(tmp_path):
    p = mp.get_context("spawn").Process(target=_writer, args=(str(tmp_path), 50))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    st = DiskBlockStore(tmp_path, 1 << 26)
    assert st.get("k7") == bytes([7]) * 1000
    assert st.get("missing") is None
    key = part_key(bytes(32), LayerRange(0, 4))
    assert key.endswith(":L0-4")


def test_disk_store_is_bounded(tmp_path):
    st = DiskBlockStore(tmp_path, size_limit_bytes=200_000)
    for i in range(100):
        st.put(f"k{i}", bytes(10_000))
    assert st.volume_bytes() < 400_000  # diskcache culls past the limit (SQLite pages count too)
    assert not st.contains("k0") and st.contains("k99")
