"""tandem's vLLM KV connector: vLLM's KV-connector API (``KVConnectorBase_V1``) over tandem's block store.

Loaded by vLLM through ``kv_connector_module_path="tandem.cloud.engines.connector"``,
``kv_connector="TandemConnector"``; the connector patches nothing in vLLM. One class serves both
cloud engines (``kv_both``): the tail-prefill engine (``layer_offset = k``) loads the tail KV of a
session's earlier turns and saves that of every full prompt block; the decode engine
(``layer_offset = 0``) loads every layer of the block-aligned prompt prefix, and in remote prefill
saves the prompt's other full blocks. What each engine does in a turn: docs/architecture.md, "The
data path of one split request" and "Remote prefill".

Per request the gateway passes a ``cloud.engines.kvparams.KVTransferSpec`` in
``SamplingParams.extra_args["kv_transfer_params"]`` (``spec.to_vllm()``): the parts (layer range +
one content key per block) that must all be stored for a block to load, and the part this engine
saves. Requests without ``"tandem"`` params run as plain vLLM requests (no load, no save).

Modules, split by the process each part runs in, as vLLM's own connectors are:

* ``connector``: ``TandemConnector``, instantiated by vLLM once per engine process with its role;
  it builds only that role's side and delegates each API call to it;
* ``scheduler``: ``TandemConnectorScheduler``, in the EngineCore: per request, the tokens the
  store can supply; per step, the blocks to load and to save (``TandemMetadata``);
* ``worker``: ``TandemConnectorWorker``, in each model-runner worker: the paged layout
  (``cloud.engines.kv_layout``), the loads into the paged cache, the copies out of it and the
  writer thread that stores them;
* ``metadata``: ``ConnectorSettings`` (read from vLLM's config) and the per-step ``TandemMetadata``
  vLLM carries from the scheduler to the workers.

An unsupported paged layout fails the engine's start with ``KVLayoutError``; any other error while
planning, loading or saving a request's blocks becomes blocks vLLM recomputes, never an exception
that ends the EngineCore (docs/design-decisions.md, "The connector and vLLM").
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
