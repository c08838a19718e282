"""tandem's vLLM KV connector: vLLM's KV-connector API (``KVConnectorBase_V1``) over tandem's block store.

Loaded by vLLM through ``kv_connector_module_path="tandem.cloud.engines.connector"``,
``kv_connector="TandemConnector"``; the connector patches nothing in vLLM. One class
serves both cloud engines:

* tail-prefill engine (``kv_both``, ``layer_offset = k``): *loads* tail KV of a
  session's earlier turns, computes the rest from ``prompt_embeds`` and *saves*
  the tail KV (global layers ``[k, L)``) of every full prompt block;
* decode engine (``kv_both``, ``layer_offset = 0``): *loads* all layers of
  the block-aligned prompt prefix (head part from the edge, tail part from the
  tail engine) and lets vLLM compute the partial last block and decode; in remote
  prefill its one part covers every layer, loaded where the session's earlier turns
  stored it and *saved* for the prompt's other full blocks (which go down to the edge).

Per request the gateway passes a ``cloud.engines.kvparams.KVTransferSpec`` in
``SamplingParams.extra_args["kv_transfer_params"]`` (``spec.to_vllm()``): the parts
(layer range + one content key per block) that must all be stored for a block to
load, and the part this engine saves. Keys commit to the inputs the KV was computed
from, so a stored block is only ever loaded for the same inputs.
Requests without ``"tandem"`` params run as plain vLLM requests (no load, no save).

As vLLM's own connectors, the package is split by the process each part runs in:

* ``connector``: ``TandemConnector``, the class vLLM instantiates once per engine process
  with its role; it builds only that role's side and delegates each API call to it;
* ``scheduler``: ``TandemConnectorScheduler``, in the EngineCore: per request, the tokens the
  store can supply; per step, the blocks to load and to save (``TandemMetadata``);
* ``worker``: ``TandemConnectorWorker``, in each model-runner worker: the paged layout
  (``cloud.engines.kv_layout``), the loads into the paged cache, the copies out of it and the
  writer thread that stores them;
* ``metadata``: what both sides share: ``ConnectorSettings`` (read from vLLM's config) and the
  per-step ``TandemMetadata`` vLLM carries from the scheduler to the workers.

Faults stay inside the request: the paged layout is checked when vLLM registers the engine's
caches (an unsupported backend or shape fails the engine's start with ``KVLayoutError``), and
any error while planning, loading or saving a request's blocks is logged and turns into missing
blocks that vLLM recomputes, never into an exception that would end the EngineCore.
"""

from tandem.cloud.engines.connector.connector import TandemConnector
from tandem.cloud.engines.connector.metadata import ConnectorSettings, PartOp, TandemMetadata
from tandem.cloud.engines.connector.scheduler import TandemConnectorScheduler
from tandem.cloud.engines.connector.worker import TandemConnectorWorker

__all__ = [
    "ConnectorSettings",
    "PartOp",
    "TandemConnector",
    "TandemConnectorScheduler",
    "TandemConnectorWorker",
    "TandemMetadata",
]
