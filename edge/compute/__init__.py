"""The edge's compute on ONNX Runtime: the split heads and their batcher, and the whole model under the
local engine (the model builder's graph or edge-full.onnx)."""
