"""GPU sampler: without NVML it says so and stays idle; with an NVML it reports the gauges."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvscope import semconv
from kvscope.collector import gpu
from tests.stores import query

GIB = 1 << 30


class FakeNvml:
    """pynvml's API at the library boundary: two devices, per-process use on the first only."""

    class NVMLError(Exception):
        pass

    def __init__(self, *, init_fails: bool = False, count: int = 2) -> None:
        self.init_fails = init_fails
        self.count = count
        self.used = [10 * GIB, 3 * GIB]
        self.fail_reads = False
        self.shutdowns = 0

    def nvmlInit(self) -> None:
        if self.init_fails:
            raise self.NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        if self.fail_reads:
            raise self.NVMLError("GPU is lost")
        return SimpleNamespace(used=self.used[handle], total=80 * GIB, free=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        if handle == 1:
            raise self.NVMLError("Not Supported")
        # A second process whose use NVML may not say (None), as in containers.
        return [SimpleNamespace(pid=4242, usedGpuMemory=9 * GIB),
                SimpleNamespace(pid=4343, usedGpuMemory=None)]


def _points(reader: InMemoryMetricReader) -> dict[str, dict[tuple[Any, ...], float]]:
    out: dict[str, dict[tuple[Any, ...], float]] = {}
    data = reader.get_metrics_data()
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                for p in metric.data.data_points:
                    key = tuple(sorted(p.attributes.items()))
                    out.setdefault(metric.name, {})[key] = p.value
    return out


def _sampler(nvml: Any) -> tuple[gpu.GpuSampler, InMemoryMetricReader]:
    reader = InMemoryMetricReader()
    meter = MeterProvider(metric_readers=[reader]).get_meter(semconv.SCOPE_NAME)
    return gpu.GpuSampler(meter, host="h1", nvml=nvml), reader


def test_gauges_from_a_substituted_nvml() -> None:
    nvml = FakeNvml()
    sampler, reader = _sampler(nvml)
    assert sampler.start()
    points = _points(reader)
    dev = [((semconv.GPU_HOST, "h1"), (semconv.GPU_INDEX, i)) for i in (0, 1)]
    assert points[semconv.METRIC_GPU_MEMORY_USED] == {dev[0]: 10 * GIB, dev[1]: 3 * GIB}
    assert points[semconv.METRIC_GPU_MEMORY_TOTAL] == {dev[0]: 80 * GIB, dev[1]: 80 * GIB}
    assert points[semconv.METRIC_GPU_PROCESS_MEMORY_USED] == {
        ((semconv.GPU_HOST, "h1"), (semconv.GPU_INDEX, 0), (semconv.GPU_PID, 4242)): 9 * GIB}
    nvml.used[0] = 20 * GIB  # each collection is a fresh sample
    assert _points(reader)[semconv.METRIC_GPU_MEMORY_USED][dev[0]] == 20 * GIB
    sampler.close()
    assert nvml.shutdowns == 1


def test_nvml_errors_while_sampling_are_counted_not_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = FakeNvml()
    sampler, reader = _sampler(nvml)
    assert sampler.start()
    nvml.fail_reads = True
    with caplog.at_level(logging.ERROR, logger=gpu.__name__):
        for _ in range(3):
            assert semconv.METRIC_GPU_MEMORY_USED not in _points(reader)
    assert sampler.errors == 3
    assert len([r for r in caplog.records if "NVML read failed" in r.message]) == 1


@pytest.mark.parametrize("nvml", [FakeNvml(init_fails=True), FakeNvml(count=0)])
def test_without_a_gpu_the_in_process_sampler_stays_idle(nvml: FakeNvml) -> None:
    sampler, reader = _sampler(nvml)
    assert not sampler.start()
    assert sampler.unavailable_reason
    assert _points(reader) == {}
    assert sampler.sample() == []


def test_real_pynvml_without_nvidia_hardware_says_so() -> None:
    pynvml = gpu.load_nvml()
    assert pynvml is not None, "pynvml is a kvscope dependency"
    sampler, _ = _sampler(None)
    if sampler.start():  # pragma: no cover - only on a machine with an NVIDIA driver
        sampler.close()
        pytest.skip("this machine has an NVIDIA GPU; the absent-NVML path needs none")
    assert "NVML" in sampler.unavailable_reason


def test_without_nvml_the_sampler_says_why_and_waits_for_nothing(tmp_path: Path) -> None:
    db = tmp_path / "gpu.duckdb"
    waited: list[bool] = []
    why = gpu.run_sampler(db=str(db), otlp_endpoint=None, interval_s=1.0,
                          wait=lambda: waited.append(True), nvml=FakeNvml(init_fails=True))
    assert why is not None and "NVML" in why and not waited


def test_command_exits_cleanly_on_a_machine_without_a_gpu(tmp_path: Path) -> None:
    """The real command, end to end: no NVIDIA driver here is a clean exit, not an error."""
    result = subprocess.run(
        [sys.executable, "-m", "kvscope.cli", "gpu-sampler", "--db", str(tmp_path / "g.duckdb"),
         "--duration-s", "0.2"], capture_output=True, text=True, timeout=120)
    if "nothing to sample" not in result.stdout:  # pragma: no cover - a machine with a GPU
        pytest.skip("this machine has an NVIDIA GPU; the no-GPU exit needs none")
    assert result.returncode == 0, result.stderr


def test_command_writes_samples_to_the_store(tmp_path: Path) -> None:
    db = tmp_path / "gpu.duckdb"
    stop = threading.Event()
    timer = threading.Timer(0.5, stop.set)
    timer.start()
    assert gpu.run_sampler(db=str(db), otlp_endpoint=None, interval_s=0.1, wait=stop.wait,
                           nvml=FakeNvml()) is None
    rows = query(db, "SELECT MetricName, Attributes[?], Value, ServiceName FROM otel_metrics_gauge "
                     "WHERE MetricName = ? ORDER BY 2",
                 [semconv.GPU_INDEX, semconv.METRIC_GPU_MEMORY_USED])
    assert {(r[1], r[2]) for r in rows} == {("0", 10 * GIB), ("1", 3 * GIB)}
    assert {r[3] for r in rows} == {semconv.SERVICE_GPU_SAMPLER}
