"""The serving modes as one enum (``common.protocol.modes.Mode``) and their conversions at the API
boundaries: protobuf ``tandem.v1.Mode``, the names the SDK and the OpenAI API take, ``ChatTurn.from_pb``."""

from __future__ import annotations

import pytest

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.modes import Mode
from tandem.edge.events import ChatTurn
from tandem.v1 import tandem_pb2 as pb


def test_every_proto_mode_converts_and_unspecified_is_auto():
    assert {v: Mode.from_pb(v) for v in pb.Mode.values()} == {
        pb.MODE_UNSPECIFIED: Mode.AUTO,
        pb.MODE_AUTO: Mode.AUTO,
        pb.MODE_SPLIT: Mode.SPLIT,
        pb.MODE_DIRECT: Mode.DIRECT,
        pb.MODE_LOCAL: Mode.LOCAL,
        pb.MODE_REMOTE_PREFILL: Mode.REMOTE_PREFILL,
    }
    assert all(Mode.from_pb(m.to_pb()) is m for m in Mode)
    with pytest.raises(InvalidRequest, match="unknown mode 99"):
        Mode.from_pb(99)


def test_names_are_the_apis_names():
    assert [Mode.from_name(n) for n in ("auto", "local", "split", "direct", "remote_prefill")] == list(Mode)
    assert f"{Mode.SPLIT}" == "split" and Mode.DIRECT.value == "direct"
    with pytest.raises(InvalidRequest, match="mode must be one of"):
        Mode.from_name("cloud")


def test_a_chat_request_takes_its_mode_and_split_layer_only_with_split():
    r = pb.ChatRequest(prompt="hi", mode=pb.MODE_SPLIT, split_layer=4)
    assert (ChatTurn.from_pb(r).mode, ChatTurn.from_pb(r).split_layer) == (Mode.SPLIT, 4)
    assert ChatTurn.from_pb(pb.ChatRequest(prompt="hi")).mode is Mode.AUTO
    with pytest.raises(InvalidRequest, match="split_layer is for mode split only"):
        ChatTurn.from_pb(pb.ChatRequest(prompt="hi", mode=pb.MODE_DIRECT, split_layer=4))
    with pytest.raises(InvalidRequest, match="unknown mode 17"):
        ChatTurn.from_pb(pb.ChatRequest(prompt="hi", mode=17))


def test_a_chat_request_says_whether_its_client_uses_the_reply_only_whole():
    assert ChatTurn.from_pb(pb.ChatRequest(prompt="hi", whole_reply=True)).whole_reply
    assert not ChatTurn.from_pb(pb.ChatRequest(prompt="hi")).whole_reply  # unset: a streamed turn
