"""Code shared by the edge and the cloud: wire codecs, integrity (CRC32C, Merkle),
KV block layout, link parameters, model splitting and export.

Nothing here imports gRPC servers, ONNX Runtime sessions or vLLM engines at
import time; heavy imports happen inside the functions that need them.
"""
