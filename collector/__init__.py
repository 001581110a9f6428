"""Collectors: OpenTelemetry set-up and exporters, the OTLP receiver, the proxy, vLLM hooks,
the GPU sampler.

    otel.py             tracer/meter providers and exporters for the plugin, proxy and sampler
    queue_counts.py     the counters of a drop-and-count queue (span processor, engine records)
    exporters.py        the DuckDB span and metric exporters (the store extra)
    engine_telemetry.py the engine-side spans and gauges (shared by the hooks and the emulator)
    span_rows.py        spans written straight as store rows (the simulator's fast path)
    receiver.py         ``kvscope serve``: OTLP/HTTP and OTLP/gRPC into the store
    otlp_decode.py, otlp_intake.py, otlp_grpc.py, convert.py   the receiver's decoding layers;
                        otlp_admission.py its admission by bytes
    gpu.py              the NVML GPU memory sampler
    proxy/, vllm/, ingest/   the proxy, the vLLM hooks, importers of runs made without kvscope

Nothing is imported with the package: the vLLM plugin path must stay light.
"""

__all__ = [
    "convert", "engine_telemetry", "exporters", "gpu", "ingest", "otel", "otlp_admission",
    "otlp_decode", "otlp_grpc", "otlp_intake", "proxy", "queue_counts", "receiver", "span_rows",
    "vllm",
]
