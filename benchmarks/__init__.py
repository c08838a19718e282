"""Latency benchmarks: tandem split vs cloud-only vs edge-only over emulated links."""
