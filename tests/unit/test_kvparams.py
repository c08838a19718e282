"""The typed seams of the KV connector: the per-request spec and the connector's report, each
through the dict vLLM carries (``kv_transfer_params``)."""

from __future__ import annotations

import pytest

from tandem.cloud.engines.kvparams import ConnectorReport, KVTransferSpec, PartSpec
from tandem.common.wire.kvblocks import LayerRange


def test_a_spec_round_trips_through_vllm_params():
    head = PartSpec(LayerRange(lo=0, hi=4), (bytes(32), bytes([1]) * 32))
    tail = PartSpec(LayerRange(lo=4, hi=30), (bytes([2]) * 32,))
    spec = KVTransferSpec(loads=(head, tail), save=tail)
    assert KVTransferSpec.from_vllm(spec.to_vllm()) == spec
    assert spec.num_blocks == 1
    assert KVTransferSpec.from_vllm(None) is None and KVTransferSpec.from_vllm({"other": 1}) is None


def test_a_connector_report_round_trips_and_a_plain_request_reports_zeros():
    report = ConnectorReport(external_tokens=96, saved_blocks=4)
    assert report.to_vllm() == {"tandem": {"external_tokens": 96, "saved_blocks": 4}}  # what vLLM carries
    assert ConnectorReport.from_vllm(report.to_vllm()) == report
    assert ConnectorReport.from_vllm(None) == ConnectorReport.from_vllm({}) == ConnectorReport(0, 0)
    assert ConnectorReport.from_vllm({"tandem": {"external_tokens": 32}}) == ConnectorReport(32, 0)


@pytest.mark.parametrize(
    "params", [{"tandem": [1, 2]}, {"tandem": {"saved_blocks": None}}, {"tandem": {"external_tokens": "x"}}]
)
def test_a_malformed_connector_report_is_a_value_error(params):
    with pytest.raises(ValueError):
        ConnectorReport.from_vllm(params)
