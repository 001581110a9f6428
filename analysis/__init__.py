"""Analyses: the per-turn reuse ledger and the registered analyses built on it.

    registry.py   the registry of analyses and intermediates, and the analysis context
    runs.py       runs: the run table, naming runs, feature state, workload, baselines, pairs
    ledger.py     the per-turn reuse ledger (outcome, tokens, evidence) from the stored spans
    ledger_units.py  the ledger of chosen conversations; kvscope_ledger kept current
    stored_queries.py  span queries whose results kvscope ledger keeps beside the ledger
    reuse.py      reuse rates; causes.py missed-reuse causes; retention.py retention cost and
                  memory; task_time.py task time; windows.py turns over time and by engine;
                  sources.py which evidence a run or store holds; compare.py two runs side by side;
                  whatif.py and ladder.py other settings replayed, cost_fit.py the costs they
                  are priced at; verdict.py the per-run verdict; published.py the published
                  sweep beside its simulation; live_metrics.py the ledger kept current as
                  spans arrive, as Prometheus series;
                  live_queries.py analyses answered by kvscope serve while it writes

Every module registers its analyses on import (see :data:`registry.MODULES`); nothing here is
imported with the package.
"""

__all__ = [
    "causes", "compare", "cost_fit", "ladder", "ledger", "ledger_units", "live_metrics",
    "live_queries", "published", "reconcile", "registry", "retention", "reuse", "runs",
    "sources", "stored_queries", "task_time", "verdict", "whatif", "windows",
]
