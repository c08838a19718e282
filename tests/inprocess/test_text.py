"""Strings from clients are text (``common.protocol.text``): the check itself, the domain boundary
(``edge.events.ChatTurn``) and the edge's gRPC API over a real in-process server (toy stack).
The HTTP API's side is in ``tests/inprocess/test_openai_api.py``."""

from __future__ import annotations

import re

import grpc
import pytest

from tandem.common.protocol.errors import InvalidRequest
from tandem.common.protocol.text import check_text, find_non_text, text_problem
from tandem.common.runtime.grpc_setup import add_service, start_server
from tandem.edge.events import ChatTurn
from tandem.edge.server import EDGE_SERVICE, EdgeServicer
from tandem.v1 import tandem_pb2 as pb
from tests.doubles import toy_stack


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("\ud800 hi", "a lone surrogate U+D800 at character 0"),
        ("ok\udfff", "a lone surrogate U+DFFF at character 2"),
        ("a\x00b", "a NUL character at character 1"),
    ],
)
def test_not_text(value, problem):
    """A lone surrogate or a NUL is not text: text_problem names it and its position, and check_text raises
    InvalidRequest naming the field."""
    assert text_problem(value) == problem
    with pytest.raises(InvalidRequest, match=f"^prompt: not valid text: {re.escape(problem)}$"):
        check_text(value, "prompt")


@pytest.mark.parametrize("value", ["", "plain", "tabs\tand\nnewlines\r", "é 漢字 😀 \U0010ffff", "\x01\x7f"])
def test_text(value):
    """Any other string (empty, control characters, tabs and newlines, any plane of Unicode) is text and
    passes unchanged."""
    assert text_problem(value) is None and check_text(value, "x") == value


def test_find_non_text_walks_keys_lists_and_nesting():
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "fine"}, {"text": "x\ud800"}]}]}
    assert find_non_text(body) == (("messages", 0, "content", 1, "text"), "a lone surrogate U+D800 at character 1")
    assert find_non_text({"a": {"\x00": 1}}) == (("a",), "a key with a NUL character at character 0")
    assert find_non_text({"a": [1, 2.5, None, True, "ok"]}) is None


@pytest.mark.parametrize(
    ("kw", "where"),
    [
        ({"messages": (("user", "\ud800 hi"),)}, "messages.[0].content"),
        ({"messages": (("user", "hi"), ("us\x00er", "x"))}, "messages.[1].role"),
        ({"prompt": "\udfff"}, "prompt"),
        ({"prompt": "hi", "session_id": "s\x00"}, "session_id"),
        ({"prompt": "hi", "stop": ("ok", "\ud800")}, "stop.[1]"),
    ],
)
def test_a_chat_turn_holds_text_only(kw, where):
    with pytest.raises(InvalidRequest, match=rf"^{re.escape(where)}: not valid text") as ei:
        ChatTurn(**kw)
    assert (ei.value.param, ei.value.code) == (where, "invalid_value")


@pytest.fixture(scope="module")
async def edge_port():
    toy = await toy_stack()
    servicer = EdgeServicer(toy.edge, "toy")
    server, port, _ = await start_server(
        [lambda s: add_service(s, servicer, "Edge")], [EDGE_SERVICE], "127.0.0.1", 0, 1 << 20
    )
    yield port
    await server.stop(0)
    await toy.batcher.stop()


async def chat_status(port: int, request: bytes) -> tuple[grpc.StatusCode, str]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        call = ch.unary_stream(f"/{EDGE_SERVICE}/Chat", request_serializer=None, response_deserializer=None)(request)
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e.code(), e.details() or ""
        return await call.code(), ""


def msg(role: str = "user", content: str = "hi") -> pb.ChatMessage:
    return pb.ChatMessage(role=role, content=content)


NUL_REQUESTS = [
    pb.ChatRequest(messages=[msg(content="a\x00b")]),
    pb.ChatRequest(messages=[msg(), msg(role="user\x00")]),
    pb.ChatRequest(prompt="\x00"),
    pb.ChatRequest(prompt="hi", session_id="s\x00"),
    pb.ChatRequest(prompt="hi", stop=["ok", "\x00"]),
]


@pytest.mark.parametrize("request_pb", NUL_REQUESTS)
async def test_grpc_strings_with_a_nul_are_invalid_argument(edge_port, request_pb):
    """protobuf carries NUL in a string field: the edge refuses it where the request becomes a turn."""
    request_pb.sampling.max_new_tokens = 2
    code, details = await chat_status(edge_port, request_pb.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not valid text: a NUL character" in details


async def test_grpc_strings_with_a_surrogate_never_parse(edge_port):
    """A surrogate encoded as UTF-8 (``ED A0 80``) is bad UTF-8: protobuf refuses the message."""
    good = pb.ChatRequest(prompt="ab").SerializeToString()
    code, details = await chat_status(edge_port, good.replace(b"\x02ab", b"\x03\xed\xa0\x80"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in details
    ok = pb.ChatRequest(prompt="ok", sampling=pb.SamplingParams(max_new_tokens=2))
    code, _ = await chat_status(edge_port, ok.SerializeToString())
    assert code == grpc.StatusCode.OK
