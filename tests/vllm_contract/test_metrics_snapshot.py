"""A /metrics snapshot written by vLLM 0.33.0's own PrometheusStatLogger, read by kvscope ingest.

The real ``PrometheusStatLogger`` (``v1/metrics/loggers.py``) of a prefill engine built as the
end-to-end tests build it (real Scheduler, real NixlConnector) records the real scheduler's stats
after a pulled read, an iteration's prompt tokens by source (``PromptTokenStats`` fed a
``PrefillStats`` of that read) and one interval of real ``NixlKVConnectorStats``; the snapshot is
``prometheus_client.generate_latest`` of the registry vLLM writes to, as ``GET /metrics``
serves it. The parser must find every series under vLLM's own names and labels.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from vllm import SamplingParams

from kvscope.collector.ingest import KINDS, detect, vllm_metrics
from tests.vllm_contract import test_scheduler_e2e as e2e
from tests.vllm_contract.test_real_scheduler_claims import Runner, add

model_dir = e2e.model_dir
model_config = e2e.model_config


def test_the_real_prometheus_logger_s_series_are_read(tmp_path: Path,
                                                       model_config: Any) -> None:  # noqa: F811
    import prometheus_client
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats, PrefillStats

    p = e2e.Engine(model_config, "kv_producer", prefix_caching=False, log_stats=True)
    pulled = "chatcmpl-metrics-pull-Ab12Cd34"
    add(p, pulled, 170, e2e.offer(160), SamplingParams(max_tokens=1))
    runner = Runner(p)
    for _ in range(3):
        out = p.scheduler.schedule()
        p.scheduler.update_from_output(out, runner.answer(out))
    stats = NixlKVConnectorStats()
    stats.record_transfer(SimpleNamespace(xferDuration=1500, postDuration=200,
                                          totalBytes=4 * 2**20, descCount=32))
    stats.record_failed_transfer()
    stats.record_kv_expired_req()
    scheduler_stats = p.scheduler.make_stats()
    assert scheduler_stats is not None
    scheduler_stats.kv_connector_stats = stats.data
    iteration = IterationStats()
    iteration.prompt_token_stats.update_from_output(PrefillStats(
        num_prompt_tokens=170, num_computed_tokens=10, num_cached_tokens=160,
        num_local_cached_tokens=0, num_external_cached_tokens=160))

    logger = PrometheusStatLogger(p.config, engine_indexes=[0])
    logger.record(scheduler_stats, iteration, engine_idx=0)
    path = tmp_path / "prefill.metrics"
    path.write_bytes(prometheus_client.generate_latest(prometheus_client.REGISTRY))

    text = path.read_text()
    assert detect(path) is KINDS[vllm_metrics.KIND], text[:2000]
    parsed = vllm_metrics.read_prefill(path)
    (counters,) = parsed.engines.values()
    expected = {
        "prompt_tokens_external_kv_transfer": 160, "prompt_tokens_local_compute": 10,
        "prompt_tokens_local_cache_hit": 0, "nixl_transfers": 1,
        "nixl_bytes_transferred": 4 * 2**20, "nixl_failed_transfers": 1,
        "nixl_kv_expired_reqs": 1, "nixl_notifications_after_expiry": 0,
    }
    assert {name: counters.get(name) for name in expected} == expected, text
    # Every cache tier vLLM declares is a series (0 where nothing came from it).
    assert {k for k in counters if k.startswith("cached_tokens_")} >= {
        "cached_tokens_device", "cached_tokens_p2p", "cached_tokens_external_unspecified"}
