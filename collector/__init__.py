"""Collectors: OpenTelemetry set-up and exporters, the OTLP receiver, the proxy, vLLM hooks,
the GPU sampler."""
