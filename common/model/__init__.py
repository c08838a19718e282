"""Model preparation (``tandem-model``): ONNX exports of the edge's heads and whole model (tandem's own
and ONNX Runtime GenAI's model builder), their checks against HF, behaviour switches, and the bundles
each host role installs."""
