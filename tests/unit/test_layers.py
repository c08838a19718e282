"""The layering of ``tests/layers.py`` holds: every module has a layer, no import runs upward or
between the edge and the cloud."""

from __future__ import annotations

import pytest

from tests.layers import layer_of, tandem_modules, violations


def test_every_module_has_a_layer():
    missing = []
    for module in tandem_modules():
        try:
            layer_of(module)
        except LookupError as e:
            missing.append(str(e))
    assert not missing, "\n".join(missing)


def test_no_import_runs_upward_or_across():
    found = violations()
    assert not found, "imports against the layering:\n" + "\n".join(found)


@pytest.mark.parametrize(
    ("module", "target", "ok"),
    [
        ("tandem.edge.api.http_api", "tandem.edge.node", True),
        ("tandem.edge.compute.local", "tandem.edge.node", False),
        ("tandem.common.wire.chunks", "tandem.common.protocol.errors", True),
        ("tandem.common.protocol.params", "tandem.common.wire.chunks", False),
        ("tandem.cloud.uploads.receive", "tandem.cloud.sessions.sync", True),
        ("tandem.cloud.engines.connector", "tandem.cloud.gateway", False),
    ],
)
def test_the_layer_order_reads_as_written(module, target, ok):
    assert (layer_of(target) <= layer_of(module)) is ok
