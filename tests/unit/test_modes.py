"""The serving modes as one enum (``common.protocol.modes.Mode``) and their conversions at the API
boundaries: protobuf ``tandem.v1.Mode``, the names the SDK and the OpenAI API take, ``ChatTurn.from_pb``."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

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


def test_the_cloud_serves_each_header_by_its_mode():
    """``cloud.gateway.mode_of`` gives the ``Mode`` a header asks for, the key of its path."""
    from tandem.cloud.gateway import mode_of
    from tandem.common.protocol.params import Sampling
    from tandem.common.wire.kvdown import RemotePrefill
    from tandem.common.wire.messages import TurnHeader

    direct = TurnHeader(
        request_id="r",
        session_id="",
        params_version=1,
        split_layer=0,
        prompt_token_ids=(1, 2, 3),
        cached_tokens=0,
        num_chunks=0,
        num_kv_blocks=0,
        sampling=Sampling(),
        link_id="l",
    )
    assert mode_of(direct) is Mode.DIRECT
    assert mode_of(replace(direct, split_layer=4)) is Mode.SPLIT
    assert mode_of(replace(direct, remote_prefill=RemotePrefill(held_tokens=0))) is Mode.REMOTE_PREFILL


MODE_NAMES = frozenset(m.value for m in Mode) - {"auto"}  # "auto" is also other settings' word (dtype, device)
ADAPTERS = ("edge/api/",)  # the JSON and gRPC edges, where a mode is its name


def _mode_names_decided_on(path: Path) -> list[str]:
    """Where ``path`` compares with a mode's name or keys a mapping by one (``x == "split"``,
    ``x in ("split", ...)``, ``{"split": ...}``, ``case "split"``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[ast.expr] = []
        if isinstance(node, ast.Compare):
            for e in [node.left, *node.comparators]:
                names += e.elts if isinstance(e, ast.Tuple | ast.List | ast.Set) else [e]
        elif isinstance(node, ast.Dict):
            names += [k for k in node.keys if k is not None]
        elif isinstance(node, ast.MatchValue):
            names.append(node.value)
        found += [
            f"{path}:{n.lineno}: {n.value!r}"
            for n in names
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in MODE_NAMES
        ]
    return found


def test_the_daemons_decide_on_the_mode_enum_not_on_its_name():
    """The edge and the cloud branch and dispatch on ``Mode`` members; a mode's name appears only
    where it leaves or enters (the APIs' adapters, logs, metric labels)."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for folder in ("edge", "cloud"):
        for path in sorted((root / folder).rglob("*.py")):
            if not str(path.relative_to(root)).startswith(ADAPTERS):
                found += _mode_names_decided_on(path)
    assert not found, "\n".join(found)
    assert _mode_names_decided_on(Path(__file__)), "the scan finds the names this test writes"


def _names_this_file_decides_on(mode: str) -> bool:
    return {"split": True}.get(mode, mode == "direct")  # what the scan above must find
