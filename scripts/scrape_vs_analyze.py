"""Print kvscope serve's /metrics (scraped, parsed by prometheus_client's parser) beside
`kvscope analyze` on the same store: the figures behind tests/analysis/test_live_metrics.py.

Run from the repository root:  .venv/bin/python scripts/scrape_vs_analyze.py
"""
# ruff: noqa
import json, subprocess, sys, tempfile
from pathlib import Path
sys.path[:0] = [".", "tests/analysis"]  # the repository root: tests.stores
import httpx
from prometheus_client.parser import text_string_to_metric_families
from test_live_metrics import MIX, _copy_runs, _shuffled_batches
from kvscope.analysis.live_metrics import metrics_source
from kvscope.collector.receiver import Receiver
from kvscope.emulator.simulator import SimulationSettings, simulate
from kvscope.emulator.workloads import synthetic
from kvscope.store.schema import TRACES_ARROW
d = Path(tempfile.mkdtemp()); src = d / "source.duckdb"
w = synthetic.generate(seed=5, conversations=8, turns_p50=6, max_turns=9, system_prompt_tokens=700, new_input_tokens_p50=250, think_time_p50_s=4, think_time_p90_s=30, reset_probability=0.08, subagent_probability=0.1)
simulate(w, src, SimulationSettings(profile="tiny", label="faults", seed=17, faults=MIX, decoder_kv_blocks_ttl=20.0, kv_load_failure_policy="recompute"))
simulate(w, src, SimulationSettings(profile="tiny", label="plain", seed=3, model="other-model"))
db = d / "served.duckdb"
r = Receiver(db, port=0, metrics=metrics_source).start()
c = r.writer.connection.cursor(); _copy_runs(src, c); c.close()
for b in _shuffled_batches(src, 5, 3):
    r.writer.submit_traces(b.cast(TRACES_ARROW)); r.writer.flush(30); httpx.get(f"{r.url}/metrics")
text = httpx.get(f"{r.url}/metrics").text
r.stop()
fam = {f.name: f.samples for f in text_string_to_metric_families(text)}
def v(name, sample=None, **l):
    return sum(s.value for s in fam[name] if s.name == (sample or name) and all(s.labels.get(k) == x for k, x in l.items()))
an = json.loads(subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(db), "reuse_rate", "--format", "json"], capture_output=True, text=True).stdout)
mc = json.loads(subprocess.run([sys.executable, "-m", "kvscope.cli", "analyze", str(db), "miss_causes", "--format", "json"], capture_output=True, text=True).stdout)
runs = subprocess.run([sys.executable, "-m", "kvscope.cli", "sql", str(db), "SELECT run_id, label FROM kvscope_runs", "--format", "csv"], capture_output=True, text=True).stdout
labels = dict(line.split(",", 1) for line in runs.splitlines()[1:])
print("run     series                      scraped    analyze")
for row in an:
    rid = row["run_id"]; lab = labels[rid]
    for series, col in [("kvscope_reusable_tokens","reusable_tokens"),("kvscope_reused_local_tokens","local_tokens"),("kvscope_reused_remote_tokens","remote_tokens"),("kvscope_recomputed_reusable_tokens","recomputed_tokens")]:
        print(f"{lab:7s} {series:34s} {v(series, run_id=rid):10.0f} {row[col]:10}")
    rate = (v("kvscope_reused_local_tokens", run_id=rid)+v("kvscope_reused_remote_tokens", run_id=rid))/v("kvscope_reusable_tokens", run_id=rid)
    print(f"{lab:7s} {'token reuse rate':34s} {rate:10.4f} {row['token_reuse_rate']:10.4f}")
for row in mc:
    lab = labels[row["run_id"]]
    scraped = v("kvscope_turns", run_id=row["run_id"], outcome=row["outcome"])
    print(f"{lab:7s} turns k>=2 {row['outcome']:23s} (scraped, all k) {scraped:5.0f} analyze {row['turns']}")
