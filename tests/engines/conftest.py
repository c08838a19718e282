"""The engines tier's shared stack: one real cloud (vLLM tail engines at k = 4 and 8 and the decode
engine) and one edge, started once per test run and used by every module that needs a plain
deployment (split, direct, local and remote prefill over mutual TLS); modules that restart, kill or
reconfigure a cloud start their own."""

from __future__ import annotations

import pytest

from tests.helpers import SplitClient


@pytest.fixture(scope="session")
async def stack(split_dir, tmp_path_factory, tls, redis_server):
    """The real stack as an operator deploys it across hosts: mutual TLS and an edge key between
    edge and cloud, TLS and an API key between the app and the edge (all on loopback here); the
    block store on a Redis server (Debian's redis-server), so replicas can share it."""
    from tandem.cloud.config import CloudConfig, EngineConfig
    from tandem.cloud.engines.vllm_engines import VllmEngines
    from tandem.cloud.server import create_cloud
    from tandem.edge.config import EdgeConfig
    from tandem.edge.server import create_edge

    k8 = split_dir.parent / "split-k8"  # a second split layer: one more tail engine, one more head
    cfg = CloudConfig(
        split_dir=split_dir,
        extra_split_dirs=[k8],
        host="127.0.0.1",
        port=0,
        store_dir=tmp_path_factory.mktemp("kv"),
        store_url=redis_server.url,
        engine=EngineConfig(max_num_seqs=8, kv_cache_bytes=384 << 20),
        wire_dtypes=["fp32"],  # exactness: the split's greedy tokens must equal the unsplit references
        kv_wire_dtypes=["fp32"],
        tls_cert_file=tls.cloud[0],
        tls_key_file=tls.cloud[1],
        tls_client_ca_file=tls.ca_file,
        edge_keys={"edge-1": tls.edge_key},
    )
    engines = VllmEngines(cfg)
    engines.start()
    cloud = await create_cloud(cfg, engines)
    edge_cfg = EdgeConfig(
        split_dir=split_dir,
        extra_split_dirs=[k8],
        cloud_target=f"127.0.0.1:{cloud.port}",
        cloud_ca_file=tls.ca_file,
        cloud_cert_file=tls.edge_client[0],
        cloud_key_file=tls.edge_client[1],
        cloud_api_key=tls.edge_key,
        host="127.0.0.1",
        port=0,
        tls_cert_file=tls.edge_server[0],
        tls_key_file=tls.edge_server[1],
        api_keys=[tls.app_key],
        remote_prefill_prompt_kv="download",  # the remote-prefill tests' faults are the downlink's; they set others
    )
    edge = await create_edge(edge_cfg)
    client = SplitClient(f"127.0.0.1:{edge.port}", ca_file=tls.ca_file, api_key=tls.app_key)
    st = {"engines": engines, "cloud": cloud, "gateway": cloud.gateway, "cloud_port": cloud.port, "edge": edge}
    st.update(client=client, cfg=cfg, edge_cfg=edge_cfg, tls=tls)
    yield st
    await client.close()
    await edge.stop(1)
    await st["cloud"].stop(1)
    engines.shutdown()
