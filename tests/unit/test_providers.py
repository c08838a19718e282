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


def test_set_options_override_the_callers_and_defaults_fill_in():
    from tandem.edge.compute.head import with_cuda_options

    given = [("CUDAExecutionProvider", {"enable_cuda_graph": "1", "device_id": "0"}), "CPUExecutionProvider"]
    assert with_cuda_options(given, {"enable_cuda_graph": "0"}, {"use_tf32": "0"}) == [
        ("CUDAExecutionProvider", {"use_tf32": "0", "enable_cuda_graph": "0", "device_id": "0"}),
        "CPUExecutionProvider",
    ]
