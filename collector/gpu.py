"""GPU memory sampler: pynvml readings of used/total device memory as OpenTelemetry gauges.

Gauges (DESIGN §3): ``kvscope.gpu.memory.used_bytes`` and ``kvscope.gpu.memory.total_bytes``
with attributes host and GPU index, plus ``kvscope.gpu.process.memory.used_bytes`` (host, index,
pid) where NVML reports per-process use. They are observable gauges, so a sample is taken each
time the meter provider's reader collects: the sampling interval is the reader's interval.

Two ways to run it: :class:`GpuSampler` inside a process that already has a meter (stays idle
when NVML is unavailable), or :func:`main` (``python -m kvscope.collector.gpu``, for ``kvscope
gpu-sampler``), which exports to a store file or a kvscope receiver until stopped. Without NVIDIA
hardware both say so once and go on (the command exits 0); NVML errors while sampling are counted
and logged once, never raised into the host.
"""

from __future__ import annotations

import logging
import socket
import threading
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from kvscope import semconv

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuMemorySample:
    """One device's memory at one moment (bytes); ``processes`` maps pid → bytes used."""

    index: int
    used_bytes: int
    total_bytes: int
    processes: tuple[tuple[int, int], ...] = ()


def load_nvml() -> Any:
    """The pynvml module (from nvidia-ml-py), or None when it is not installed."""
    try:
        with warnings.catch_warnings():
            # The deprecated "pynvml" shim, if a user installed it, warns on import.
            warnings.simplefilter("ignore", FutureWarning)
            import pynvml
    except Exception:  # not installed, or broken: the sampler stays idle
        return None
    return pynvml


def read_samples(nvml: Any) -> list[GpuMemorySample]:
    """Read every device's memory through an initialised NVML (pynvml's API)."""
    samples = []
    for index in range(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        processes: tuple[tuple[int, int], ...] = ()
        try:
            running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            processes = tuple(
                (int(p.pid), int(p.usedGpuMemory))
                for p in running
                # NVML reports None (or a sentinel) when it may not say, e.g. in containers.
                if isinstance(p.usedGpuMemory, int) and 0 <= p.usedGpuMemory < memory.total
            )
        except Exception:  # per-process use is optional: NVML_ERROR_NOT_SUPPORTED etc.
            processes = ()
        samples.append(GpuMemorySample(index, int(memory.used), int(memory.total), processes))
    return samples


class GpuSampler:
    """Registers the GPU memory gauges on a meter and answers them from NVML."""

    def __init__(self, meter: Meter, *, host: str | None = None, nvml: Any = None) -> None:
        self._meter = meter
        self.host = host or socket.gethostname()
        self._nvml = nvml
        self._lock = threading.Lock()
        self._last: list[GpuMemorySample] = []
        self.available = False
        self.errors = 0
        self.unavailable_reason = ""
        self._warned = False

    def start(self) -> bool:
        """Initialise NVML and register the gauges; False (said once) when NVML is unavailable."""
        nvml = self._nvml if self._nvml is not None else load_nvml()
        if nvml is None:
            return self._unavailable("pynvml is not installed")
        try:
            nvml.nvmlInit()
            count = nvml.nvmlDeviceGetCount()
        except Exception as exc:
            return self._unavailable(f"NVML is not available ({exc})")
        if count == 0:
            return self._unavailable("NVML reports no GPUs")
        self._nvml = nvml
        self.available = True
        attrs = semconv.REGISTRY
        self._meter.create_observable_gauge(
            semconv.METRIC_GPU_MEMORY_USED, callbacks=[self._observe_used], unit="By",
            description=attrs[semconv.METRIC_GPU_MEMORY_USED].description)
        self._meter.create_observable_gauge(
            semconv.METRIC_GPU_MEMORY_TOTAL, callbacks=[self._observe_total], unit="By",
            description=attrs[semconv.METRIC_GPU_MEMORY_TOTAL].description)
        self._meter.create_observable_gauge(
            semconv.METRIC_GPU_PROCESS_MEMORY_USED, callbacks=[self._observe_processes],
            unit="By", description=attrs[semconv.METRIC_GPU_PROCESS_MEMORY_USED].description)
        logger.info("kvscope: sampling %d GPU(s) on %s", count, self.host)
        return True

    def _unavailable(self, reason: str) -> bool:
        self.unavailable_reason = reason
        logger.warning("kvscope gpu sampler: %s; no GPU memory samples will be taken", reason)
        return False

    def sample(self) -> list[GpuMemorySample]:
        """Read NVML now; on error keep nothing, count it and log once."""
        if not self.available:
            return []
        try:
            samples = read_samples(self._nvml)
        except Exception:
            self.errors += 1
            if not self._warned:
                self._warned = True
                logger.exception("kvscope gpu sampler: NVML read failed (further failures "
                                 "counted)")
            samples = []
        with self._lock:
            self._last = samples
        return samples

    def _attrs(self, index: int) -> dict[str, Any]:
        return {semconv.GPU_HOST: self.host, semconv.GPU_INDEX: index}

    # The reader calls used, total and processes in turn: one NVML read serves all three.
    def _observe_used(self, _options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.used_bytes, self._attrs(s.index)) for s in self.sample()]

    def _observe_total(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            last = list(self._last)
        return [Observation(s.total_bytes, self._attrs(s.index)) for s in last]

    def _observe_processes(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            last = list(self._last)
        return [
            Observation(used, {**self._attrs(s.index), semconv.GPU_PID: pid})
            for s in last
            for pid, used in s.processes
        ]

    def close(self) -> None:
        """Shut NVML down (the gauges then report nothing)."""
        if self.available:
            self.available = False
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                logger.debug("nvmlShutdown failed", exc_info=True)


def run_sampler(*, db: str | None, otlp_endpoint: str | None, interval_s: float,
                wait: Callable[[], object], nvml: Any = None) -> str | None:
    """Sample GPU memory and export it (to a store and/or OTLP) until ``wait()`` returns.

    Returns None, or why there was nothing to sample (no NVML, no driver): then it returns at
    once, having exported nothing. Everything sampled is flushed before it returns.
    """
    from kvscope.collector.otel import setup_telemetry

    telemetry = setup_telemetry(semconv.SERVICE_GPU_SAMPLER, db=db or None,
                                otlp_endpoint=otlp_endpoint or None, metric_interval_s=interval_s)
    sampler = GpuSampler(telemetry.meter(), nvml=nvml)
    try:
        if not sampler.start():
            return sampler.unavailable_reason
        wait()
        return None
    finally:
        telemetry.flush(10)
        sampler.close()
        telemetry.shutdown()


__all__ = ["GpuMemorySample", "GpuSampler", "load_nvml", "read_samples", "run_sampler"]
