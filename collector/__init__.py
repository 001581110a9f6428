"""Collectors: OpenTelemetry setup and exporters, the OTLP receiver, the proxy, vLLM hooks, GPU sampler."""
