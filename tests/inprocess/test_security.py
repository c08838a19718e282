"""TLS and mutual TLS on both hops, API keys, state scoped by identity, per-edge limits,
private store folders. Real grpc.aio over loopback with a throwaway CA (trustme); in-memory engines
and head (fast). Every refusal is checked for its status while a good session on the same cloud
completes with the reference tokens (the same turns on a plaintext in-process stack)."""

from __future__ import annotations

import asyncio
import datetime as dt
import io
import logging
import os
import stat
from pathlib import Path

import grpc
import pytest
import trustme

from tandem.cloud.engines.memory import MemoryEngines
from tandem.cloud.gateway import Gateway
from tandem.cloud.server import build_gateway
from tandem.cloud.service import CloudServicer
from tandem.cloud.store.blocks import MemoryBlockStore
from tandem.cloud.store.disk import DiskBlockStore
from tandem.common.protocol.errors import (
    EngineError,
    InvalidRequest,
    QuotaExceeded,
    TurnTooLarge,
    Unauthenticated,
)
from tandem.common.protocol.grpc_errors import retry_after_ms
from tandem.common.protocol.modes import Mode
from tandem.common.protocol.params import NegotiateOffer, Sampling
from tandem.common.runtime.grpc_setup import add_service, channel_credentials, server_credentials, start_server
from tandem.common.runtime.security import ApiKeys, Authenticator, private_dir
from tandem.edge.api.grpc_service import EDGE_SERVICE, EdgeServicer
from tandem.edge.events import ChatTurn
from tandem.edge.link.grpc_link import GrpcCloudLink
from tandem.edge.node import EdgeNode
from tandem.v1 import tandem_pb2 as pb
from tandem.v1 import tandem_pb2_grpc as pb_grpc
from tests.doubles import MANIFEST, VOCAB, B, K, ToyTokenizer, cloud_config, toy_stack
from tests.helpers import close_edge, edge_over, run

KEYS = {"edge-a": "a" * 24, "edge-b": "b" * 24, "edge-c": "c" * 24}
APP_KEYS = ["app-key-one-0123456789", "app-key-two-0123456789"]
LONG = "Tell me about bridges and arches. " * 6  # several KV blocks


# --- a throwaway PKI ------------------------------------------------------------------------------


class Pki:
    """A CA, a second (untrusted) CA, and certificate files made from them under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root, self.ca, self.other = root, trustme.CA(), trustme.CA()
        self.ca_file = self._write(self.ca.cert_pem.bytes(), "ca.pem")
        self.other_ca_file = self._write(self.other.cert_pem.bytes(), "other-ca.pem")

    def _write(self, data: bytes, name: str) -> Path:
        p = self.root / name
        p.write_bytes(data)
        return p

    def leaf(
        self, name: str, *identities: str, ca: trustme.CA | None = None, expired: bool = False
    ) -> tuple[Path, Path]:
        """(cert chain file, key file) for ``identities`` (subject alternative names), common name ``name``."""
        kw = {}
        if expired:
            now = dt.datetime.now(dt.UTC)
            kw = dict(not_before=now - dt.timedelta(days=30), not_after=now - dt.timedelta(days=1))
        cert = (ca or self.ca).issue_cert(*(identities or (name,)), common_name=name, **kw)
        chain = b"".join(b.bytes() for b in cert.cert_chain_pems)
        return self._write(chain, f"{name}.pem"), self._write(cert.private_key_pem.bytes(), f"{name}.key")


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


# --- a cloud over TLS -----------------------------------------------------------------------------


class TlsCloud:
    """The toy gateway on a grpc server with TLS (mutual when ``client_ca``), edge keys optional."""

    def __init__(self, pki: Pki, *, client_ca: bool = True, keys: dict[str, str] | None = None, **cfg) -> None:
        self.pki, self.client_ca, self.keys = pki, client_ca, keys or {}
        self.store = MemoryBlockStore(1 << 30)
        self.engines = MemoryEngines(self.store, B, VOCAB)
        self.cfg = cloud_config(**cfg)
        self.cert = pki.leaf("cloud", "localhost", "127.0.0.1")

    async def start(self) -> None:
        self.gateway = build_gateway(self.cfg, MANIFEST, self.engines, self.store)
        auth = Authenticator(ApiKeys(self.keys), client_certs=self.client_ca)
        servicer = CloudServicer(self.gateway, "toy-cloud", auth)
        creds = server_credentials(self.cert[0], self.cert[1], self.pki.ca_file if self.client_ca else None)
        self.server, self.port, _ = await start_server(
            [lambda s: add_service(s, servicer, "Cloud")],
            ["tandem.v1.Cloud"],
            "127.0.0.1",
            0,
            self.gateway.registry.max_message_bytes(),
            creds,
        )

    async def stop(self) -> None:
        await self.server.stop(0)


def link_to(
    port: int,
    *,
    ca: Path | None,
    cert: tuple[Path, Path] | None = None,
    api_key: str | None = None,
    host: str = "localhost",
    server_name: str | None = None,
) -> GrpcCloudLink:
    creds = channel_credentials(ca, *(cert or (None, None)))
    return GrpcCloudLink(f"{host}:{port}", 5.0, 5.0, credentials=creds, server_name=server_name, api_key=api_key)


def chat(convo: list[tuple[str, str]], session: str = "", n: int = 6) -> ChatTurn:
    return ChatTurn(
        messages=tuple(convo), prompt="", session_id=session, sampling=Sampling(max_new_tokens=n), mode=Mode.SPLIT
    )


async def conversation(svc: EdgeNode, session: str, turns: int = 3) -> list[tuple[int, ...]]:
    """A multi-turn chat; returns each turn's output token ids."""
    convo: list[tuple[str, str]] = [("user", LONG)]
    out = []
    for i in range(turns):
        done = await run(svc, chat(convo, session))
        out.append(done.output_token_ids)
        if i:
            assert done.head_tokens < done.prompt_tokens  # the session's prefix stayed on both sides
        convo += [("assistant", "sure"), ("user", f"and question {i}?")]
    return out


@pytest.fixture(scope="module")
async def reference() -> list[tuple[int, ...]]:
    """The reference tokens: the same conversation on a plaintext in-process stack."""
    toy = await toy_stack()
    try:
        return await conversation(toy.edge, "ref")
    finally:
        await toy.batcher.stop()


# --- edge <-> cloud: mutual TLS -------------------------------------------------------------------


async def test_mutual_tls_serves_and_every_bad_certificate_is_refused_while_a_good_session_runs(pki, reference):
    cloud = TlsCloud(pki)
    await cloud.start()
    good = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-a")))
    bad_links = {
        "no client certificate": link_to(cloud.port, ca=pki.ca_file),
        "client certificate of another CA": link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("x", ca=pki.other)),
        "expired client certificate": link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("old", expired=True)),
        "cloud certificate of an untrusted CA": link_to(cloud.port, ca=pki.other_ca_file, cert=pki.leaf("edge-b")),
        "cloud certificate for another name": link_to(
            cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-b"), server_name="other.example"
        ),
    }

    async def refused(name: str, link: GrpcCloudLink) -> str:
        try:
            for _ in range(3):
                with pytest.raises(EngineError, match="UNAVAILABLE"):
                    await link.negotiate(
                        NegotiateOffer(edge_id="intruder", model_id="toy", head_keys={}, edge_max_batch=1)
                    )
        finally:
            await link.close()
        return name

    try:
        results = await asyncio.gather(
            conversation(good, "s"), *(refused(name, link) for name, link in bad_links.items())
        )
        assert results[0] == reference
        # the cloud names the edge by its certificate's subject
        (owner,) = {o for lid, o in cloud.gateway.registry._owners.items() if lid}
        assert owner == "cert:edge-a"
    finally:
        await close_edge(good)
        await cloud.stop()


async def test_the_edge_checks_the_clouds_name_and_expiry(pki):
    """Server-side checks from the edge's view: a cloud certificate for another name is refused,
    and accepted when that name is configured (``cloud_server_name``); an expired one is refused."""
    cloud = TlsCloud(pki, client_ca=False)
    cloud.cert = pki.leaf("named", "cloud.internal")
    await cloud.start()
    try:
        wrong = link_to(cloud.port, ca=pki.ca_file)
        with pytest.raises(EngineError, match="UNAVAILABLE"):
            await wrong.negotiate(NegotiateOffer(edge_id="e", model_id="toy", head_keys={}, edge_max_batch=1))
        await wrong.close()
        right = link_to(cloud.port, ca=pki.ca_file, server_name="cloud.internal")
        assert (
            await right.negotiate(NegotiateOffer(edge_id="e", model_id="toy", head_keys={}, edge_max_batch=1))
        ).link_id
        await right.close()
    finally:
        await cloud.stop()
    expired = TlsCloud(pki, client_ca=False)
    expired.cert = pki.leaf("stale", "localhost", expired=True)
    await expired.start()
    try:
        link = link_to(expired.port, ca=pki.ca_file)
        with pytest.raises(EngineError, match="UNAVAILABLE"):
            await link.negotiate(NegotiateOffer(edge_id="e", model_id="toy", head_keys={}, edge_max_batch=1))
        await link.close()
    finally:
        await expired.stop()


# --- edge <-> cloud: tokens, scoped state, per-edge limits ----------------------------------------


def raw_header(
    gw: Gateway, session: str, ids: list[int], cached: int, link_id: str = "", version: int = 0
) -> pb.Uplink:
    rec = gw.registry._versions[link_id]
    v = version or rec.current[K].params_version
    return pb.Uplink(
        header=pb.RequestHeader(
            request_id="r",
            session_id=session,
            params_version=v,
            split_layer=K,
            prompt_token_ids=ids,
            cached_tokens=cached,
            num_chunks=1,
            sampling=pb.SamplingParams(max_new_tokens=2),
            link_id=link_id,
        )
    )


async def raw_generate(
    port: int, pki: Pki, key: str | None, msgs: list[pb.Uplink], cert: str = "raw"
) -> grpc.StatusCode:
    """Generate with ``msgs`` as the holder of ``key`` and of a client certificate for ``cert``."""
    creds = channel_credentials(pki.ca_file, *pki.leaf(cert))
    async with grpc.aio.secure_channel(f"localhost:{port}", creds) as ch:
        stub = pb_grpc.CloudStub(ch)
        md = (("authorization", f"Bearer {key}"),) if key else None
        try:
            async for _ in stub.Generate(iter(msgs), metadata=md, timeout=10):
                pass
        except grpc.aio.AioRpcError as e:
            return e.code()
    return grpc.StatusCode.OK


async def test_tokens_name_edges_and_scope_their_sessions_and_links(pki, reference):
    cloud = TlsCloud(pki, keys=KEYS)
    await cloud.start()
    a = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-a"), api_key=KEYS["edge-a"]), "a")
    b = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-b"), api_key=KEYS["edge-b"]), "b")
    try:
        # missing and wrong token: UNAUTHENTICATED on every RPC
        for key in (None, "not-a-key-0123456789", KEYS["edge-a"][:-1] + "x"):
            link = link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-x"), api_key=key)
            with pytest.raises(Unauthenticated):
                await link.negotiate(NegotiateOffer(edge_id="x", model_id="toy", head_keys={}, edge_max_batch=1))
            with pytest.raises(Unauthenticated):
                await link.server_info("")
            await link.close()
            ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
            code = await raw_generate(cloud.port, pki, key, [raw_header(cloud.gateway, "", ids, 0)])
            assert code == grpc.StatusCode.UNAUTHENTICATED
        # edge a's session runs; edge b guesses its id: NOT_FOUND, never a's state
        first = await run(a, chat([("user", LONG)], "shared"))
        ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": LONG}])
        code = await raw_generate(
            cloud.port, pki, KEYS["edge-b"], [raw_header(cloud.gateway, "shared", ids + [5], len(ids))], "edge-b"
        )
        assert code == grpc.StatusCode.NOT_FOUND
        # b's own session of the same name is another session (b resends everything)
        mine = await run(b, chat([("user", LONG)], "shared"))
        assert mine.head_tokens == mine.prompt_tokens
        # b may not use a's link (header) nor read its params
        a_link = a.conn.negotiated.link_id
        code = await raw_generate(
            cloud.port, pki, KEYS["edge-b"], [raw_header(cloud.gateway, "", ids, 0, link_id=a_link)], "edge-b"
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert not (await b.conn.link.server_info(a_link)).link_known
        assert (await a.conn.link.server_info(a_link)).link_known
        # a's session is intact: its next turns load only new tokens and give the reference tokens
        assert first.output_token_ids == reference[0]
        convo = [("user", LONG), ("assistant", "sure"), ("user", "and question 0?")]
        second = await run(a, chat(convo, "shared"))
        assert second.head_tokens < second.prompt_tokens and second.output_token_ids == reference[1]
    finally:
        await close_edge(a)
        await close_edge(b)
        await cloud.stop()


async def test_a_key_is_bound_to_the_certificate_subject_it_was_issued_for(pki, reference):
    """With mutual TLS and edge keys both on, a key is accepted only with a certificate whose subject
    is the key's name: edge-a's certificate with edge-b's key (or any other mismatched pairing) is
    UNAUTHENTICATED on every RPC, never served as either edge, while edge a, with its own pair, is
    served."""
    cloud = TlsCloud(pki, keys=KEYS)
    await cloud.start()
    a = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-a"), api_key=KEYS["edge-a"]), "a")
    ids = ToyTokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    mismatched = {
        "edge-a's certificate, edge-b's key": ("edge-a", (), KEYS["edge-b"]),
        "edge-b's certificate, edge-a's key": ("edge-b", (), KEYS["edge-a"]),
        "a certificate of no key's name, edge-a's key": ("intruder", (), KEYS["edge-a"]),
        "edge-a only as an alternative name, edge-a's key": ("edge-x", ("edge-x", "edge-a"), KEYS["edge-a"]),
    }
    try:
        for case, (name, alt_names, key) in mismatched.items():
            link = link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf(name, *alt_names), api_key=key)
            try:
                with pytest.raises(Unauthenticated, match="not issued for this client certificate"):
                    await link.negotiate(NegotiateOffer(edge_id="x", model_id="toy", head_keys={}, edge_max_batch=1))
                with pytest.raises(Unauthenticated):
                    await link.server_info("")
            finally:
                await link.close()
            code = await raw_generate(cloud.port, pki, key, [raw_header(cloud.gateway, "", ids, 0)], name)
            assert code == grpc.StatusCode.UNAUTHENTICATED, case
        assert await conversation(a, "s") == reference
        assert {o for lid, o in cloud.gateway.registry._owners.items() if lid} == {"key:edge-a"}
    finally:
        await close_edge(a)
        await cloud.stop()


async def test_a_caller_claiming_another_edge_id_is_logged_and_traced_as_the_identity_it_proved(pki):
    """A caller with edge-a's credentials claiming ``edge_id`` "edge-b" (with a forged log line in it)
    is served as edge-a, and its link is named, logged and traced as edge-a: the link id starts with
    the authenticated name, the SLO controller knows the link as edge-a's, and every log line and span
    of its calls names ``caller=key:edge-a``."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from tandem.common.runtime import tracing
    from tandem.common.runtime.logs import setup_logging

    buf = io.StringIO()
    root = logging.getLogger()
    level = root.level
    handler = setup_logging("text", "DEBUG", stream=buf)
    exporter = InMemorySpanExporter()
    assert tracing.setup_tracing(True, "tandem-test", exporter=exporter)
    cloud = TlsCloud(pki, keys=KEYS)
    await cloud.start()
    claimed = "edge-b\n2026-12-06 05:00:00,000 tandem.cloud ERROR FORGED"
    a = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-a"), api_key=KEYS["edge-a"]), claimed)
    try:
        await run(a, chat([("user", "hi")], "s"))
    finally:
        await close_edge(a)
        await cloud.stop()
        tracing.setup_tracing(False, "tandem-test")
        root.removeHandler(handler)
        root.setLevel(level)
    link_id = a.conn.negotiated.link_id
    assert link_id.startswith("edge-a-") and cloud.gateway.links.get(link_id).edge_id == "edge-a"
    lines = buf.getvalue().splitlines()
    assert not [x for x in lines if x.startswith("2026-12-06 05:00:00,000")]  # no forged line
    assert all("edge-b\\n2026-12-06 05:00:00,000 tandem.cloud ERROR FORGED" in x for x in lines if "FORGED" in x)
    cloud_lines = [x for x in lines if " tandem.cloud " in x]
    negotiated = [x for x in cloud_lines if f"link {link_id} negotiated" in x]
    assert negotiated and "caller=key:edge-a]" in negotiated[0] and "edge-b\\n2026" in negotiated[0]
    done = [x for x in cloud_lines if "turn done" in x]
    assert done and all("caller=key:edge-a]" in x and f"link_id={link_id}" in x for x in done)
    (turn_span,) = [s for s in exporter.get_finished_spans() if s.name == "cloud_turn"]
    assert turn_span.attributes["caller"] == "key:edge-a" and turn_span.attributes["link_id"] == link_id


def test_keys_without_names_cannot_be_bound_to_certificates(pki):
    from pydantic import ValidationError

    from tandem.edge.config import EdgeConfig

    with pytest.raises(InvalidRequest, match="name each key"):
        Authenticator(ApiKeys(APP_KEYS), client_certs=True)
    assert Authenticator(ApiKeys({"app": APP_KEYS[0]}), client_certs=True).required
    cert, key = pki.leaf("edge", "localhost")
    tls = {"tls_cert_file": cert, "tls_key_file": key, "tls_client_ca_file": pki.ca_file}
    with pytest.raises(ValidationError, match="api_keys"):
        EdgeConfig(api_keys=APP_KEYS, **tls)
    assert (
        EdgeConfig(http_api_keys=APP_KEYS, **tls).tls_client_ca_file == pki.ca_file
    )  # HTTP has no client certificates


async def test_an_edge_over_its_limits_gets_resource_exhausted_and_others_are_served(pki, reference):
    cloud = TlsCloud(pki, keys=KEYS, edge_max_sessions=2, edge_rate_limit="8/second", edge_max_stored_bytes=1 << 30)
    await cloud.start()
    c = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-c"), api_key=KEYS["edge-c"]), "c")
    a = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-a"), api_key=KEYS["edge-a"]), "a")
    try:
        # sessions: the third new session of edge c takes the place of its least recently used one
        # (c1, kept in the block store); all three keep working, within the bound of two
        await run(c, chat([("user", "one")], "c1", n=2))
        await run(c, chat([("user", "two")], "c2", n=2))
        await run(c, chat([("user", "three")], "c3", n=2))
        await run(c, chat([("user", "one"), ("assistant", "x"), ("user", "more")], "c1", n=2))
        assert len(cloud.gateway.sessions) == 2
        await asyncio.sleep(1.1)  # a fresh rate window
        # rate: a burst past 8/second is refused with a retry delay, while edge a is served
        burst = [run(c, chat([("user", f"q{i}")], n=1)) for i in range(12)]
        results = await asyncio.gather(conversation(a, "a"), *burst, return_exceptions=True)
        assert results[0] == reference
        refused = [r for r in results[1:] if isinstance(r, QuotaExceeded)]
        assert refused and all("rate" in str(r) for r in refused)
        assert not [r for r in results[1:] if isinstance(r, BaseException) and not isinstance(r, QuotaExceeded)]
    finally:
        await close_edge(c)
        await close_edge(a)
        await cloud.stop()


async def test_stored_bytes_per_edge_are_bounded(pki):
    cloud = TlsCloud(pki, keys=KEYS, edge_max_stored_bytes=40_000, edge_rate_limit=None)
    await cloud.start()
    c = await edge_over(link_to(cloud.port, ca=pki.ca_file, cert=pki.leaf("edge-c"), api_key=KEYS["edge-c"]), "c")
    try:
        await run(c, chat([("user", "short")], "small", n=1))
        with pytest.raises(TurnTooLarge, match="edge_max_stored_bytes") as e:  # alone: it can never fit
            await run(c, chat([("user", LONG * 3)], "big", n=1))
        assert retry_after_ms(e.value) is None  # across the real gRPC link: no retry hint
        assert cloud.gateway.receiver.budget.uploads == 0
    finally:
        await close_edge(c)
        await cloud.stop()


# --- app <-> edge: TLS and API keys ---------------------------------------------------------------


async def test_the_edge_serves_apps_over_tls_with_api_keys_and_scopes_sessions_by_key(pki):
    from tandem import AsyncClient, Unavailable
    from tandem import Unauthenticated as ClientUnauthenticated

    toy = await toy_stack()
    cert = pki.leaf("edge", "localhost")
    servicer = EdgeServicer(toy.edge, "toy", Authenticator(ApiKeys(APP_KEYS)))
    server, port, _ = await start_server(
        [lambda s: add_service(s, servicer, "Edge")],
        [EDGE_SERVICE],
        "127.0.0.1",
        0,
        1 << 20,
        server_credentials(cert[0], cert[1], None),
    )
    msg = [{"role": "user", "content": "hello there"}]
    try:
        for key in (None, "wrong-key-0123456789"):
            async with AsyncClient(f"localhost:{port}", ca_file=pki.ca_file, api_key=key) as c:
                with pytest.raises(ClientUnauthenticated):
                    await c.complete(msg, max_new_tokens=2)
                with pytest.raises(ClientUnauthenticated):
                    await c.info()
        async with AsyncClient(f"localhost:{port}", insecure=True, api_key=APP_KEYS[0]) as c:
            with pytest.raises(Unavailable):  # plaintext to a TLS port
                await c.complete(msg, max_new_tokens=2, timeout_s=5)
        async with AsyncClient(f"localhost:{port}", ca_file=pki.other_ca_file, api_key=APP_KEYS[0]) as c:
            with pytest.raises(Unavailable):  # the edge's certificate does not chain to this CA
                await c.complete(msg, max_new_tokens=2, timeout_s=5)
        one = AsyncClient(f"localhost:{port}", ca_file=pki.ca_file, api_key=APP_KEYS[0])
        two = AsyncClient(f"localhost:{port}", ca_file=pki.ca_file, api_key=APP_KEYS[1])
        r1 = await one.complete(msg, max_new_tokens=3, session_id="user-42", mode="split")
        r2 = await two.complete(msg, max_new_tokens=3, session_id="user-42", mode="split")
        assert r1.output_token_ids == r2.output_token_ids
        assert r2.head_tokens == r2.prompt_tokens  # key two's "user-42" is not key one's
        assert len([k for k in toy.edge.sessions._s if k.endswith("/user-42")]) == 2
        assert "user-42" not in toy.edge.sessions
        long_id = "s" * 128  # the longest id a client may send: still a session in split mode
        first = await one.complete(msg, max_new_tokens=2, session_id=long_id, mode="split")
        again = await one.complete(
            [*msg, {"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}],
            max_new_tokens=2,
            session_id=long_id,
            mode="split",
        )
        assert first.output_tokens and again.head_tokens < again.prompt_tokens
        from tandem import InvalidArgument

        with pytest.raises(InvalidArgument, match="session_id longer"):
            await one.complete(msg, max_new_tokens=2, session_id="s" * 129)
        await one.close()
        await two.close()
    finally:
        await server.stop(0)
        await toy.batcher.stop()


def test_the_sdk_sends_plaintext_only_to_this_host_unless_told():
    from tandem import Client

    with pytest.raises(ValueError, match="loopback"):
        Client("edge.example.com:50061")
    with pytest.raises(ValueError, match="cert_file and key_file"):
        Client("localhost:1", tls=True, cert_file="x.pem")
    Client("edge.example.com:50061", insecure=True).close()
    Client("127.0.0.1:1").close()
    # gRPC's multi-address targets: every address must be loopback (an operator trial sent a key in the
    # clear through the second address of one)
    with pytest.raises(ValueError, match="loopback"):
        Client("ipv6:[::1]:1,[::ffff:192.0.2.2]:50999", api_key="app-key-0123456789")
    Client("ipv4:127.0.0.1:1,127.0.0.2:2").close()


def test_daemons_refuse_plaintext_on_other_hosts_unless_told(pki):
    from pydantic import ValidationError

    from tandem.cloud.config import CloudConfig
    from tandem.edge.config import EdgeConfig

    with pytest.raises(ValidationError, match="insecure"):
        CloudConfig(host="0.0.0.0")
    assert CloudConfig(host="0.0.0.0", insecure=True).insecure
    pem, key = pki.leaf("cloud")
    assert CloudConfig(host="0.0.0.0", tls_cert_file=pem, tls_key_file=key).tls_cert_file == pem
    with pytest.raises(ValidationError, match="together"):
        CloudConfig(tls_cert_file=pem)
    with pytest.raises(ValidationError, match="cloud_insecure"):
        EdgeConfig(cloud_target="10.1.2.3:50051")
    with pytest.raises(ValidationError, match="cloud_insecure"):
        EdgeConfig(cloud_target="ipv4:127.0.0.1:50051,10.1.2.3:50051")
    with pytest.raises(ValidationError, match="cloud_replicas entry '10.1.2.4:50051'"):  # the setting it came from
        EdgeConfig(cloud_target="127.0.0.1:50051", cloud_replicas=["10.1.2.4:50051"])
    assert EdgeConfig(cloud_target="10.1.2.3:50051", cloud_ca_file=pki.ca_file).cloud_uses_tls
    with pytest.raises(ValidationError, match="http_host"):
        EdgeConfig(http_port=8000, http_host="0.0.0.0")
    with pytest.raises(InvalidRequest, match="shorter"):
        ApiKeys(["short"])


# --- state on disk ---------------------------------------------------------------------------------


def test_store_folders_are_private_and_never_another_users(tmp_path):
    d = tmp_path / "state" / "kv"
    store = DiskBlockStore(d, 1 << 20)
    store.close()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o777)
    os.chmod(loose, 0o777)
    private_dir(loose)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700
    link = tmp_path / "link"
    link.symlink_to(d)
    with pytest.raises(InvalidRequest, match="symbolic link"):
        private_dir(link)
    # an ancestor another user may write (no sticky bit) lets them swap the folder (operator trial)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(InvalidRequest, match="writable by others"):
        DiskBlockStore(shared / "kv", 1 << 20)
    os.chmod(shared, 0o1777)  # sticky, as /tmp: others cannot rename what is ours
    DiskBlockStore(shared / "kv", 1 << 20).close()
    if os.getuid() == 0:  # only root can make a folder that belongs to someone else
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 4242, 4242)
        with pytest.raises(InvalidRequest, match="belongs to user id 4242"):
            DiskBlockStore(theirs, 1 << 20)
        with pytest.raises(InvalidRequest, match="belongs to user id 4242"):
            DiskBlockStore(theirs / "kv", 1 << 20)  # their folder as the parent
    from tandem.cloud.config import CloudConfig

    default = CloudConfig().store_dir
    assert not str(default).startswith("/tmp") and "~" not in str(default)


async def test_the_openai_api_serves_https_with_its_keys(pki):
    import ssl

    import httpx

    from tandem.edge.api.http_api import create_openai_app, serve_openai, stop_openai

    toy = await toy_stack()
    cert = pki.leaf("edge-http", "localhost", "127.0.0.1")
    app = create_openai_app(toy.edge, "toy", api_keys=APP_KEYS)
    server, task, port = await serve_openai(app, "127.0.0.1", 0, tls=cert)
    trust = ssl.create_default_context(cafile=str(pki.ca_file))
    try:
        async with httpx.AsyncClient(verify=trust, timeout=10) as h:
            url = f"https://127.0.0.1:{port}/v1/models"
            assert (await h.get(url)).status_code == 401
            assert (await h.get(url, headers={"authorization": "Bearer wrong-key-0123456789"})).status_code == 401
            ok = await h.get(url, headers={"authorization": f"Bearer {APP_KEYS[1]}"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "toy"
        async with httpx.AsyncClient(timeout=10) as plain:
            with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the HTTPS port
                await plain.get(f"http://127.0.0.1:{port}/v1/models")
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(pki.other_ca_file))) as h:
            with pytest.raises(httpx.ConnectError):  # a certificate this client does not trust
                await h.get(f"https://127.0.0.1:{port}/v1/models")
    finally:
        await stop_openai(server, task, 1.0)
        await toy.batcher.stop()


async def test_negotiating_many_links_takes_nothing_from_other_edges():
    """A few hundred Negotiate calls from one identity neither dilute other links' shares nor, past
    max_links, make the cloud forget other edges' links: negotiating holds no share until a request
    comes, and one identity keeps at most edge_max_links links (its least recently used idle one is
    forgotten)."""
    from tandem.cloud.store.blocks import MemoryBlockStore as Store

    store = Store(1 << 20)
    gw = build_gateway(cloud_config(edge_max_links=3, max_links=16), MANIFEST, MemoryEngines(store, B, VOCAB), store)
    offer = NegotiateOffer(edge_id="e", model_id="toy", head_keys={K: MANIFEST.compatibility_key()}, edge_max_batch=4)
    good = gw.negotiate(offer, "good").link_id
    (await gw.links.admit(good, 1, None)).release()  # the good edge is in use
    full = gw.links.share(good)
    for _ in range(300):
        gw.negotiate(offer, "attacker")
    assert sum(1 for o in gw.registry._owners.values() if o == "peer:attacker") == 3
    assert gw.links.share(good) == full  # idle negotiated links hold no share
    assert gw.server_info(good, "good").link_known  # and pushed nothing out
