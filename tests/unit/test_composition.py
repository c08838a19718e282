"""The edge's composition root (``edge.server.build_node``): every part of an ``EdgeNode`` is built
from the config in one place, and the parts share what they must (one router, one set of sessions)."""

from __future__ import annotations

import pytest

from tandem.edge.compute.batcher import HeadBatcher
from tandem.edge.compute.head import MemoryHead
from tandem.edge.config import EdgeConfig
from tandem.edge.modes.split_head import Head
from tandem.edge.server import build_node
from tests.toy import HKV, MANIFEST, D, H, K, ToyTokenizer


def _head() -> Head:
    return Head(HeadBatcher(MemoryHead(K, H, HKV, D), 4), MANIFEST.compatibility_key())


def test_a_node_is_built_from_its_config():
    cfg = EdgeConfig(
        turn_timeout_s=12.0,
        pipeline_tokens=48,
        cloud_budget_s=2.0,
        hysteresis=0.2,
        explore_every=7,
        max_prompt_tokens=100,
        max_new_tokens=20,
        max_sessions=3,
    )
    node = build_node(cfg, ToyTokenizer(), [_head()], None, shape=MANIFEST.shape, codec_ratio=0.5, model_key="m")
    r, cost = node.router, node.cost
    assert (node.turn_timeout_s, node.max_prompt_tokens, node.max_new_tokens) == (12.0, 100, 20)
    assert (cost.pipeline_tokens, cost.hysteresis, cost.explore_every) == (48, 0.2, 7)
    assert (r.cloud_budget_ms, r.codec_ratio, r.remote_prefill, r.head_layers) == (2000.0, 0.5, True, {K})
    assert node.sessions is r.sessions is node.calls.sessions and node.sessions.max_entries == 3
    assert node.calls.router is r and node.heads == {K: node.heads[K]} and node.compute.model_key == "m"
    assert r.load().head_pending_tokens == {K: 0}  # the router reads the node's head queues
    assert not build_node(cfg, ToyTokenizer(), [_head()], None).router.remote_prefill  # no model key: none


def test_a_node_with_nothing_to_serve_is_refused():
    with pytest.raises(ValueError, match="needs a head"):
        build_node(EdgeConfig(), ToyTokenizer(), [], None)
