"""The ONNX Runtime provider lists the edge's float32 sessions use (``edge.compute.head.without_tf32``)."""

from __future__ import annotations

from tandem.edge.compute.head import without_tf32


def test_the_cuda_provider_runs_float32_matmuls_without_tf32():
    assert without_tf32(["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        ("CUDAExecutionProvider", {"use_tf32": "0"}),
        "CPUExecutionProvider",
    ]
    given = ("CUDAExecutionProvider", {"device_id": "1"})
    assert without_tf32([given]) == [("CUDAExecutionProvider", {"device_id": "1", "use_tf32": "0"})]
    assert given[1] == {"device_id": "1"}  # the caller's options are not changed


def test_a_caller_that_sets_tf32_and_other_providers_are_left_alone():
    own = ("CUDAExecutionProvider", {"use_tf32": "1"})
    assert without_tf32([own, "CPUExecutionProvider"]) == [own, "CPUExecutionProvider"]
    assert without_tf32(["CPUExecutionProvider"]) == ["CPUExecutionProvider"]
