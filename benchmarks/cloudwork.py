"""The cloud's work per request, measured from outside its processes while a benchmark runs.

* **CPU time** (user + system, psutil): of the ``tandem-cloud`` process itself (the gateway: receiving
  and verifying uploads, framing, Merkle checks, block-store writes and reads) and of its engine
  processes (vLLM's EngineCore and their workers, which on a GPU also launch kernels and wait for
  them). A process that exits between two reads counts with its last reading.
* **GPU time** where NVML is present: the cloud processes' share of the GPU, NVML's per-process SM
  utilisation samples (``nvmlDeviceGetProcessUtilization``: percent of each sample period in which a
  kernel of that process ran) integrated over their periods. It is busy time, not a cost in FLOPs: a
  kernel that uses a fraction of the SMs counts whole. An edge on the same GPU is a process of its
  own and not counted. Where the driver does not give per-process samples (``NOT_SUPPORTED``, some
  virtualised GPUs) GPU time is None, never 0; ``CloudMeter.gpu_report()`` says which PIDs NVML
  sampled, so a 0 from a PID namespace NVML does not share (a container) can be told apart.

``CloudMeter.read()`` returns cumulative totals; a cell's work is the difference of two reads
divided by the requests it served (``CloudWork.per_request``). No grpc, no engine imports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CloudWork:
    """Cumulative (or, after ``minus``, one interval's) work of the cloud's processes, in ms.
    ``gpu_ms`` is None where no GPU time was measured (no NVML, no GPU)."""

    gateway_cpu_ms: float
    engines_cpu_ms: float
    gpu_ms: float | None

    def minus(self, before: CloudWork) -> CloudWork:
        gpu = None if self.gpu_ms is None or before.gpu_ms is None else self.gpu_ms - before.gpu_ms
        return CloudWork(self.gateway_cpu_ms - before.gateway_cpu_ms, self.engines_cpu_ms - before.engines_cpu_ms, gpu)

    def per_request(self, n: int) -> CloudWork:
        """This interval's work per request over ``n`` requests (NaN for none)."""
        if n <= 0:
            return CloudWork(float("nan"), float("nan"), None if self.gpu_ms is None else float("nan"))
        gpu = None if self.gpu_ms is None else self.gpu_ms / n
        return CloudWork(self.gateway_cpu_ms / n, self.engines_cpu_ms / n, gpu)


def _cpu_ms(times: Any) -> float:
    """User + system CPU time of one process (psutil's ``cpu_times()``), ms."""
    return (times.user + times.system) * 1e3


def integrate_sm_samples(samples: Iterable[tuple[int, int, int]], pids: set[int], last_ts_us: dict[int, int]) -> float:
    """GPU-busy ms of ``pids`` in NVML process-utilisation ``samples`` ``(pid, timeStamp_us,
    smUtil_percent)``: each sample's share of the period since that pid's previous sample
    (``last_ts_us``, updated in place; a pid's first sample only starts its clock). Samples of other
    pids and samples not newer than the pid's last are skipped."""
    busy_ms = 0.0
    for pid, ts_us, sm in sorted(samples, key=lambda s: s[1]):
        if pid not in pids:
            continue
        prev = last_ts_us.get(pid)
        if prev is not None and ts_us <= prev:
            continue
        last_ts_us[pid] = ts_us
        if prev is not None:
            busy_ms += max(0, min(sm, 100)) / 100.0 * (ts_us - prev) / 1e3
    return busy_ms


def _nvml() -> Any:
    """NVML's Python binding (nvidia-ml-py, or the copy vLLM carries), initialised; None without one
    or without a GPU driver."""
    try:
        import pynvml as nvml  # type: ignore[import-not-found]
    except ImportError:
        try:
            from vllm.third_party import pynvml as nvml  # type: ignore[import-not-found,no-redef]
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
        if nvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded, ...: no GPU here
        return None
    return nvml


class CloudMeter:
    """The work of the process ``pid`` (``tandem-cloud``) and its descendants. With NVML, a thread
    polls every ``poll_s`` and integrates the GPU samples of the cloud's processes.

    Raises:
        psutil.NoSuchProcess: ``pid`` is not running.
    """

    def __init__(self, pid: int, poll_s: float = 0.1) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self._gone_ms = 0.0  # CPU time of descendants seen earlier that are gone now (their last reading)
        self._seen: dict[int, float] = {}
        self._nvml = _nvml()
        self._gpu_ms = 0.0
        self._gpu_error = ""  # the NVML error that stopped GPU sampling, "" while it works
        self._sampled_pids: set[int] = set()  # every pid NVML gave a sample for
        self._matched_pids: set[int] = set()  # those of them that were the cloud's
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self._nvml is not None:
            self._handles = [self._nvml.nvmlDeviceGetHandleByIndex(i) for i in range(self._nvml.nvmlDeviceGetCount())]
            self._last_ts: list[dict[int, int]] = [{} for _ in self._handles]
            self._since_us = [int(time.time() * 1e6)] * len(self._handles)
            self._thread = threading.Thread(target=self._poll, args=(poll_s,), daemon=True, name="cloud-gpu-meter")
            self._thread.start()

    def _pids(self) -> set[int]:
        import psutil

        try:
            return {self.proc.pid, *(c.pid for c in self.proc.children(recursive=True))}
        except psutil.Error:
            return set()

    def _poll(self, poll_s: float) -> None:
        while not self._stop.wait(poll_s):
            pids = self._pids()
            for i, h in enumerate(self._handles):
                try:
                    raw = self._nvml.nvmlDeviceGetProcessUtilization(h, self._since_us[i])
                except Exception as e:  # noqa: BLE001 - NVMLError_NotFound: no sample since the last call
                    if getattr(e, "value", None) != getattr(self._nvml, "NVML_ERROR_NOT_FOUND", 6):
                        with self._lock:  # NOT_SUPPORTED, NO_PERMISSION, ...: no GPU time from here
                            self._gpu_error = f"{type(e).__name__}: {e}"
                        return
                    continue
                samples = [(s.pid, s.timeStamp, s.smUtil) for s in raw]
                if samples:
                    self._since_us[i] = max(s[1] for s in samples)
                busy = integrate_sm_samples(samples, pids, self._last_ts[i])
                with self._lock:
                    self._gpu_ms += busy
                    self._sampled_pids.update(s[0] for s in samples)
                    self._matched_pids.update(s[0] for s in samples if s[0] in pids)

    def read(self) -> CloudWork:
        """The cumulative work so far."""
        import psutil

        gateway = _cpu_ms(self.proc.cpu_times())
        live: dict[int, float] = {}
        for c in self.proc.children(recursive=True):
            try:
                live[c.pid] = _cpu_ms(c.cpu_times())
            except psutil.Error:
                continue
        self._gone_ms += sum(ms for pid, ms in self._seen.items() if pid not in live)
        self._seen = live
        with self._lock:
            gpu = self._gpu_ms if self._nvml is not None and not self._gpu_error else None
        return CloudWork(gateway, self._gone_ms + sum(live.values()), gpu)

    def gpu_report(self) -> dict[str, Any]:
        """How GPU time was measured, for a run's metadata: ``nvml`` (present), ``error`` (the NVML
        error that stopped sampling, or ""), ``sampled_pids`` (every process NVML gave samples for)
        and ``cloud_pids`` (those that were the cloud's)."""
        with self._lock:
            return {
                "nvml": self._nvml is not None,
                "error": self._gpu_error,
                "sampled_pids": sorted(self._sampled_pids),
                "cloud_pids": sorted(self._matched_pids),
            }

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2)
