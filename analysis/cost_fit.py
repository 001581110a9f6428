"""The cost model fitted per run from its spans: what a prefill, a pull and a D→P read cost.

Its own analysis (``cost_fit``), and the prices the what-if (:mod:`kvscope.analysis.whatif`)
puts on a replayed turn. Three fits per run, each with its quality:

* ``prefill``: prefill leg minus its D→P wire time = ``a + b·computed + [pulled](h + g·pulled)``
  by least squares over observed turns (turn 1, errors and turns whose prefill leg is not
  "compute the rest" left out);
* ``transfer``: wire ms = ``latency + bytes/bandwidth`` over finished D→P ``kv_transfer`` spans;
* ``bytes_per_token``: the bytes a pulled token moved on average, block rounding included.

A term the run never measured (no pull, no read) stays null: not measured, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from kvscope.analysis import stored_queries
from kvscope.analysis.registry import (
    AnalysisContext,
    AnalysisError,
    Param,
    intermediate,
    register,
)
from kvscope.fit import solve_linear
from kvscope.reuse import outcomes

MIB = float(1 << 20)
# Turns left out of the prefill cost fit: their prefill leg is not "compute the rest".
_FIT_EXCLUDED = (outcomes.PREEMPTED, outcomes.LOAD_FAILED_ERRORED, outcomes.PREFIX_DIVERGED,
                 outcomes.REUSED_INVALID, outcomes.LOAD_STALLED,
                 outcomes.HANDSHAKE_FAILED, outcomes.TRANSFER_FAILED, outcomes.UNKNOWN)

# Finished D→P reads: the wire-time fit.
TRANSFERS = stored_queries.D2P_READS


def shape_transfers(raw: pl.DataFrame) -> pl.DataFrame:
    """Typed finished D→P reads that moved bytes: run_id, size_bytes, ms."""
    return raw.select(
        "run_id", pl.col("size_bytes").cast(pl.Float64, strict=False).cast(pl.Int64, strict=False),
        (pl.col("duration_ns").cast(pl.Float64) / 1e6).alias("ms"),
    ).filter(pl.col("size_bytes") > 0)


@dataclass(frozen=True)
class LinearFit:
    """An ordinary least-squares fit: coefficients (``intercept`` + terms), n, R², residual sd."""

    coefficients: dict[str, float]
    n: int
    r2: float | None
    residual_stdev: float | None


def least_squares(frame: pl.DataFrame, y: str, terms: Sequence[str]) -> LinearFit | None:
    """Fit ``y = intercept + Σ coef·term`` over rows with no nulls; None if underdetermined.

    Normal equations on columns scaled to unit maximum (one pass of sums, any row count); a
    term that never varies from zero, or that makes the system singular, is dropped from the
    end of ``terms`` first, and is absent from the coefficients (not measured, not 0).
    """
    data = frame.select([y, *terms]).drop_nulls()
    n = data.height
    kept = [t for t in terms if data.height and data[t].abs().max() not in (None, 0, 0.0)]
    while True:
        names = ["intercept", *kept]
        if n <= len(names) - 1 or n == 0:
            return None
        scales = [1.0] + [float(data[t].abs().max()) for t in kept]  # type: ignore[arg-type]
        # A literal would sum to 1, not n: the intercept column is built from the data.
        cols = [pl.repeat(1.0, pl.len())] + [pl.col(t).cast(pl.Float64) / s
                                for t, s in zip(kept, scales[1:], strict=True)]
        sums = data.select(
            *[(cols[i] * cols[j]).sum().alias(f"x{i}_{j}")
              for i in range(len(cols)) for j in range(i, len(cols))],
            *[(cols[i] * pl.col(y)).sum().alias(f"y{i}") for i in range(len(cols))],
        ).row(0, named=True)
        p = len(cols)
        xtx = [[float(sums[f"x{min(i, j)}_{max(i, j)}"]) for j in range(p)] for i in range(p)]
        xty = [float(sums[f"y{i}"]) for i in range(p)]
        solution = solve_linear(xtx, xty)
        if solution is None:
            if not kept:
                return None
            kept = kept[:-1]
            continue
        coefs = {name: b / s for name, b, s in zip(names, solution, scales, strict=True)}
        break
    fitted = pl.lit(coefs["intercept"]) + pl.sum_horizontal(
        [pl.col(t).cast(pl.Float64) * coefs[t] for t in kept] or [pl.lit(0.0)])
    stats = data.select(
        ((pl.col(y) - fitted) ** 2).sum().alias("ss_res"),
        ((pl.col(y) - pl.col(y).mean()) ** 2).sum().alias("ss_tot"),
    ).row(0, named=True)
    ss_res, ss_tot = float(stats["ss_res"]), float(stats["ss_tot"])
    dof = n - len(coefs)
    return LinearFit(
        coefficients=coefs,
        n=n,
        r2=1.0 - ss_res / ss_tot if ss_tot > 0 else None,
        residual_stdev=math.sqrt(ss_res / dof) if dof > 0 else None,
    )


COEFFICIENTS = (
    "fit_intercept_ms", "fit_ms_per_token", "fit_pull_fixed_ms", "fit_pull_ms_per_token",
    "fit_wire_latency_ms", "fit_wire_ms_per_byte", "fit_bytes_per_token",
)
COST_FIT_COLUMNS: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "fit": pl.String(),
    "formula": pl.String(),
    "n": pl.Int64(),
    "r2": pl.Float64(),
    "residual_stdev_ms": pl.Float64(),
    "intercept_ms": pl.Float64(),
    "slope": pl.Float64(),
    "slope_unit": pl.String(),
    "pull_fixed_ms": pl.Float64(),
    "pull_ms_per_token": pl.Float64(),
}
PREFILL_FORMULA = "prefill_ms - d2p_ms = a + b*computed + [pulled](h + g*pulled)"
TRANSFER_FORMULA = "transfer_ms = latency + bytes/bandwidth"
BYTES_FORMULA = "bytes per pulled token = sum(d2p_bytes) / sum(pulled tokens)"


def _prefill_points(ledger: pl.DataFrame) -> pl.DataFrame:
    c = pl.col
    pulled = c("remote_reused_tokens").fill_null(0)
    stale = (c("d2p_bytes").fill_null(0) > 0) & (pulled == 0)
    # Turn 1 is left out: its ledger local hit is capped at its reusable span (0), so a shared
    # system prompt's hit would read as computed tokens.
    usable = (
        (c("turn_index") >= 2) & c("reusable_tokens").is_not_null()
        & c("prefill_ms").is_not_null() & c("prompt_tokens").is_not_null()
        & ~c("errored").fill_null(False) & ~c("outcome").is_in(_FIT_EXCLUDED) & ~stale
    )
    return ledger.filter(usable.fill_null(False)).select(
        "run_id",
        (c("prefill_ms") - c("d2p_ms").fill_null(0.0)).alias("compute_ms"),
        pl.max_horizontal(c("prompt_tokens") - c("local_hit_tokens").fill_null(0) - pulled,
                          pl.lit(1)).cast(pl.Float64).alias("computed"),
        (pulled > 0).cast(pl.Float64).alias("pull_flag"),
        pulled.cast(pl.Float64).alias("pulled"),
    )


def fit_costs(ledger: pl.DataFrame, transfers: pl.DataFrame) -> pl.DataFrame:
    """Per run, the fitted cost model and its quality (pure): one row per fit.

    ``prefill``: the prefill leg without its wire time against computed tokens and the pull;
    ``transfer``: D→P read ms against bytes; ``bytes_per_token``: the bytes a pulled token
    moved on average (block rounding included). Terms not measured stay null.
    """
    rows: list[dict[str, Any]] = []
    points = _prefill_points(ledger)
    reads = ledger.filter(
        (pl.col("remote_reused_tokens").fill_null(0) > 0) & (pl.col("d2p_bytes") > 0))
    for run_id in sorted(ledger["run_id"].drop_nulls().unique().to_list()):
        fit = least_squares(points.filter(pl.col("run_id") == run_id), "compute_ms",
                            ["computed", "pull_flag", "pulled"])
        coefs = fit.coefficients if fit else {}
        rows.append({
            "run_id": run_id, "fit": "prefill", "formula": PREFILL_FORMULA,
            "n": fit.n if fit else 0, "r2": fit.r2 if fit else None,
            "residual_stdev_ms": fit.residual_stdev if fit else None,
            "intercept_ms": coefs.get("intercept"), "slope": coefs.get("computed"),
            "slope_unit": "ms/token", "pull_fixed_ms": coefs.get("pull_flag"),
            "pull_ms_per_token": coefs.get("pulled"),
        })
        wire = least_squares(transfers.filter(pl.col("run_id") == run_id), "ms", ["size_bytes"])
        wire_coefs = wire.coefficients if wire else {}
        per_byte = wire_coefs.get("size_bytes")
        rows.append({
            "run_id": run_id, "fit": "transfer", "formula": TRANSFER_FORMULA,
            "n": wire.n if wire else 0, "r2": wire.r2 if wire else None,
            "residual_stdev_ms": wire.residual_stdev if wire else None,
            "intercept_ms": wire_coefs.get("intercept"),
            "slope": per_byte * MIB if per_byte is not None else None,
            "slope_unit": "ms/MiB", "pull_fixed_ms": None, "pull_ms_per_token": None,
        })
        run_reads = reads.filter(pl.col("run_id") == run_id)
        tokens = float(run_reads["remote_reused_tokens"].sum())
        moved = float(run_reads["d2p_bytes"].sum())
        rows.append({
            "run_id": run_id, "fit": "bytes_per_token", "formula": BYTES_FORMULA,
            "n": run_reads.height, "r2": None, "residual_stdev_ms": None, "intercept_ms": None,
            "slope": moved / tokens if tokens else None,
            "slope_unit": "bytes/token", "pull_fixed_ms": None, "pull_ms_per_token": None,
        })
    return pl.DataFrame(rows, schema=COST_FIT_COLUMNS)


def coefficients(fits: pl.DataFrame) -> pl.DataFrame:
    """The fit table as one row of ``fit_*`` coefficients per run (for joining to turns)."""
    def pick(fit: str, column: str, alias: str, scale: float = 1.0) -> pl.Expr:
        return (pl.col(column).filter(pl.col("fit") == fit).first() * scale).alias(alias)

    return fits.group_by("run_id").agg(
        pick("prefill", "intercept_ms", "fit_intercept_ms"),
        pick("prefill", "slope", "fit_ms_per_token"),
        pick("prefill", "pull_fixed_ms", "fit_pull_fixed_ms"),
        pick("prefill", "pull_ms_per_token", "fit_pull_ms_per_token"),
        pick("transfer", "intercept_ms", "fit_wire_latency_ms"),
        pick("transfer", "slope", "fit_wire_ms_per_byte", 1.0 / MIB),
        pick("bytes_per_token", "slope", "fit_bytes_per_token"),
    )


def prefill_estimate(local: pl.Expr, remote: pl.Expr) -> pl.Expr:
    """Fitted prefill leg (compute + wire) of a turn with ``local`` hits that pulls ``remote``."""
    c = pl.col
    computed = pl.max_horizontal(c("prompt_tokens") - local - remote, pl.lit(1))
    pull_cost = (
        c("fit_pull_fixed_ms").fill_null(0.0) + c("fit_pull_ms_per_token").fill_null(0.0) * remote
        + c("fit_wire_latency_ms") + remote * c("fit_bytes_per_token") * c("fit_wire_ms_per_byte")
    )
    return (
        c("fit_intercept_ms") + c("fit_ms_per_token") * computed
        + pl.when(remote > 0).then(pull_cost).otherwise(0.0)
    )


# --- registered ----------------------------------------------------------------------------------


@intermediate("cost_fit_transfers", shared=True)
def _store_transfers(ctx: AnalysisContext) -> pl.DataFrame:
    """Finished D→P reads of every run in the store."""
    return shape_transfers(ctx.frame(TRANSFERS))


# What this module's analyses read of the ledger.
LEDGER_COLUMNS: tuple[str, ...] = (
    "run_id", "turn_index", "outcome", "errored", "prompt_tokens", "prefill_ms", "d2p_bytes",
    "d2p_ms", "reusable_tokens", "local_hit_tokens", "remote_reused_tokens")


def run_ledger(ctx: AnalysisContext, run: str | None,
               columns: tuple[str, ...] = LEDGER_COLUMNS) -> pl.DataFrame:
    """The ledger's ``columns`` of the selected runs, or of ``run`` only (an error naming the
    known runs when the store has no such run)."""
    ledger = ctx.ledger(("run_id", *columns))
    if run is None:
        return ledger
    known = sorted(ledger["run_id"].drop_nulls().unique().to_list())
    if run not in known:
        raise AnalysisError(f"run {run!r} not in the store; known: {', '.join(known)}")
    return ledger.filter(pl.col("run_id") == run)


@intermediate("cost_fits", shared=False)
def fits_of(ctx: AnalysisContext, run: str | None) -> pl.DataFrame:
    """The fit table (:func:`fit_costs`) of the selected runs, or of ``run``."""
    ledger = run_ledger(ctx, run)
    transfers = ctx.select_runs(ctx.get(_store_transfers))
    if run is not None:
        transfers = transfers.filter(pl.col("run_id") == run)
    return fit_costs(ledger, transfers)


@register(
    "cost_fit",
    "Cost model fitted from the observed spans (prefill vs computed tokens, wire vs bytes)",
    params=(Param("run", str, None, "only this run id (default: every selected run)"),),
    columns=COST_FIT_COLUMNS,
)
def cost_fit(ctx: AnalysisContext, params: Mapping[str, Any]) -> pl.DataFrame:
    result: pl.DataFrame = ctx.get(fits_of, params["run"])
    return result


__all__ = ["BYTES_FORMULA", "COEFFICIENTS", "COST_FIT_COLUMNS", "LEDGER_COLUMNS", "LinearFit",
    "MIB", "PREFILL_FORMULA", "TRANSFERS", "TRANSFER_FORMULA", "coefficients", "cost_fit",
    "fit_costs", "fits_of", "least_squares", "prefill_estimate", "run_ledger", "shape_transfers"]
