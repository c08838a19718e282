"""Input and output names of the exported ONNX head (and of the whole-model ``edge-full.onnx``).

Torch-free on purpose: the edge runs the head with ONNX Runtime and imports only this, while
``common.model.head_model`` (the torch module the graph is exported from) needs torch.
"""

from __future__ import annotations


def io_names(k: int) -> tuple[list[str], list[str]]:
    """ONNX input and output names of the head for split layer ``k``.

    Inputs: ``input_ids``, ``position_ids``, ``attention_mask``, then ``past_key_i``, ``past_value_i``
    for ``i`` in ``[0, k)``; outputs: ``hidden`` (``logits`` in ``edge-full.onnx``), then
    ``present_key_i``, ``present_value_i``. Shapes in ``common.model.head_model.EdgeHead``.
    """
    past = [n for i in range(k) for n in (f"past_key_{i}", f"past_value_{i}")]
    present = [n for i in range(k) for n in (f"present_key_{i}", f"present_value_{i}")]
    return ["input_ids", "position_ids", "attention_mask", *past], ["hidden", *present]
