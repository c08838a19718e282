"""The edge side of tandem: the ONNX Runtime head, per-session head KV, the
uplink to the cloud, and the daemon (``tandem-edge``) that serves the client SDK.

It imports ``common`` and the generated protobuf code, never ``cloud``.
"""
