"""A cost model from physics: prefill and transfer times from the model's shape and the
hardware's published limits, with few efficiency constants, checked by leave-one-out.

The fitted profiles of :mod:`kvscope.emulator.cost_model` reproduce the published sweep with
eight constants per model and predict nothing outside it. Here the work is counted and the
hardware's limits price it; what is fitted is how far from those limits the deployment runs.

**Prefill** of ``new`` tokens after ``context`` tokens already in KV (one engine of
``tensor_parallel_size`` GPUs)::

    FLOPs   = 2 · active parameters · new                      (every linear layer)
            + 4 · layers · attention dim · new · (context + new / 2)   (QKᵀ and AV, causal)
    compute = FLOPs / (peak FLOP/s · TP)          weights = weight bytes / (HBM B/s · TP)
    prefill_ms = fixed_ms + (compute + weights) / efficiency

``efficiency`` and ``fixed_ms`` (HTTP, scheduling, the sampled token, kernel launches) are the
two constants per model family and GPU. Compute and the weights' read add up (the serial bound)
rather than overlap (the roofline's ``max``): a layer's GEMMs wait for its weights, and in the
sweep's prefills the loads are not hidden: most are 150 tokens, and a MoE layer reads every
expert some token routes to for a few tokens each. With ``max``, GLM-5's prefills other than
its 20k OFF one sit at the weights bound, so its two constants move together and that point
cannot be predicted without itself; with the sum every point is predicted. (The choice was made
on the same 12 points the leave-one-out scores, which flatters it.)

**Transfer** of one D→P read (:func:`read_terms`)::

    transfer_ms = latency + blocks · per-block cost

two constants per interconnect (NIXL over one fabric), shared by every model on it, in the
simulator's 16-token blocks. What a block costs is what the published reads show: Qwen3-32B's
and GLM-5's reads both take ~72 µs per 16 tokens ((130 − 30) / (1,641 − 266) and (110 − 29) /
(1,391 − 266)). The bytes at the fabric's published rate (:func:`wire_ms`: ~17 ms of the 24k
read's 130) are a floor the reads sit well above, printed by the benchmark, not fitted. A pull's
prefill leg adds the pull share times the read.

**The read's host work** (:meth:`Engine.descriptors`)::

    prefill_ms += descriptors · per-descriptor cost          (a pulling turn only)

The published transfer time is NIXL's own telemetry (``xferDuration``, post to completion:
vLLM 0.29's ``NixlKVConnectorStats.record_transfer``), so what P's worker does before the post
(descriptor ids for every block of every region, ``make_prepped_xfer`` over them) is in the
prefill, not the transfer. vLLM 0.29.0 posts one descriptor per block per registered region:
64 regions of 16-token blocks for Qwen3-32B (one per layer, K and V packed), 156 regions of
64-token blocks for GLM-5 (FLASHMLA_SPARSE's only block size; a latent and an indexer-key cache
per layer), so Qwen3-32B's 24k read posts ~105k descriptors and GLM-5's 20k read ~54k, although
GLM-5 moves 2.7x the bytes per rank. One constant per host and NIXL version, shared by the
models. Without it, Qwen3-32B's 24k ON prefill (414 ms) needed ~155 ms more than its read and
its compute, which no other term gave, and GLM-5's nothing.

What the term is, though, a real NIXL does not show (``tests/benchmarks/bench_nixl_descriptors.py``,
NIXL 1.5.1, UCX over DRAM on this project's CPU machine): ``make_prepped_xfer`` costs
0.01-0.03 µs a descriptor (3 ms for 105k; the fit says 1.51 µs), and the post that does cost
per descriptor (2.4-4.8 µs each here) is inside NIXL's ``xferDuration``, the published transfer
time (``postDuration`` <= ``xferDuration``). So the term is a fitted residual per pulled
descriptor whose cause is not known (other candidates, not measured: the slowest of the 8 ranks'
reads where the published figure is their mean, the scheduler's step after a read completes).

Every constant is fitted by least squares on relative errors; the model is linear in its
constants (``fixed_ms``, ``1 / efficiency``, the latency, the per-block cost, the per-descriptor
cost), so the fit is exact linear algebra. A time that comes out negative (a fitted negative
overhead) is an error, never a number.

Each published figure is a mean over the sweep's 100 turns, and each turn is priced on its own
(:func:`terms`): the quadratic attention term is not linear, so the mean turn (a 2,550-token
prefill after 23,625 pulled) is not what the turns cost (90 prefills of 150 tokens after ~26k
pulled, 10 first turns of 24k computed whole).

What it gets (``tests/benchmarks/bench_physics_loo.py``, every published point predicted by a fit
without it): 12 of 12 within ±25 % (worst 24.6 %: Qwen3-32B's 24k ON prefill), GLM-5's headline
speedup within 7 %; Qwen3-32B's headline 2.43x for a published 1.69x (+44 %: its held-out 24k
ON prefill is what the speedup's denominator amplifies; with exact prefills the ratio would be
~1.78x). The host term was added on the same 12 points the leave-one-out scores, which flatters
it; its descriptor counts come from vLLM 0.29.0's source, not from those points. GLM-5's
attention is priced dense: DSA's sparse attention (``index_topk`` keys a query) fitted worse
(docs/benchmarks.md).

Sources (cited where the numbers are defined): NVIDIA's H100 / H200 / A100 datasheets
(:mod:`kvscope.emulator.capacity`), AWS's p5en instance page for EFA (3,200 Gbit/s a node),
the models' public configs, vLLM 0.29.0's NIXL connector and model registry. The published setup:
1 prefill + 1 decode node of 8 × H200, TP 8, EFA, NIXL LIBFABRIC (:mod:`kvscope.published`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvscope.emulator.capacity import GPUS, MODELS, Gpu, ModelShape
from kvscope.emulator.cost_model import CostProfile
from kvscope.emulator.turn_mix import TurnShape
from kvscope.fit import solve_linear


class NegativeTimeError(ValueError):
    """A cost came out below zero: the constants are wrong for this shape, not a time."""


# A model's attention width, FP8 weights, KV block size and NIXL regions are its ModelShape's
# (capacity.py): the built-ins' with their sources there, a config's read by model_config.py.
# The region counts are vLLM 0.29.0's (the published runs' version) on H200: Qwen3-32B on
# FlashAttention, vLLM's default 16-token blocks, and ``NixlBaseConnectorWorker.
# register_kv_caches`` registers one region per attention layer, K and V packed into its page
# (64). GLM-5 on FLASHMLA_SPARSE (the DeepSeek-V3.2 code): the backend's
# ``get_supported_kernel_block_sizes`` is [64]; each of the 78 layers has its latent cache and
# its indexer's key cache (``DeepseekV32IndexerCache``, a KV cache layer of its own), so a
# region each: 2 x 78. Assumed, not read off GLM-5's config: 78 layers and an indexer on every
# one (``index_topk_freq`` 1, the DeepSeek-V3.2 code's default).
# The models the published sweep fitted constants for; any other borrows its family's.
FITTED = ("qwen3-32b", "glm-5-fp8")
# NVIDIA datasheets: H100 / H200 SXM 1,979 TFLOP/s FP8 dense (A100: no FP8, BF16 used).
FP8_FLOPS = {"h100-80gb": 1979e12, "h200-141gb": 1979e12}
# AWS p5en.48xlarge: 3,200 Gbit/s of EFA per node (the published runs' fabric).
EFA_P5EN_BYTES_PER_S = 3200e9 / 8


@dataclass(frozen=True)
class Engine:
    """A model on ``tensor_parallel_size`` GPUs: the work and the limits that price it."""

    model: ModelShape
    gpu: Gpu
    tensor_parallel_size: int

    @property
    def peak_flops(self) -> float:
        fp8 = self.model.fp8_weights and self.gpu.name in FP8_FLOPS
        per_gpu = FP8_FLOPS[self.gpu.name] if fp8 else self.gpu.bf16_flops
        return per_gpu * self.tensor_parallel_size

    def prefill_flops(self, new: float, context: float) -> float:
        """FLOPs of computing ``new`` tokens after ``context`` (module docstring)."""
        attention = self.model.attention_dim
        return (2.0 * self.model.active_parameters * new
                + 4.0 * self.model.layers * attention * new * (context + new / 2.0))

    def prefill_ideal_ms(self, new: float, context: float) -> float:
        """The prefill at the hardware's limits: the compute, then reading the weights once
        (serial: module docstring)."""
        compute = self.prefill_flops(new, context) / self.peak_flops
        weights = self.model.weights_bytes / (self.gpu.hbm_bytes_per_s
                                              * self.tensor_parallel_size)
        return 1000.0 * (compute + weights)

    def descriptors(self, pulled_tokens: float) -> int:
        """NIXL descriptors one D→P read of ``pulled_tokens`` posts on each rank: one per block
        (of the model's own block size) per registered region."""
        shape = self.model
        return math.ceil(pulled_tokens / shape.kv_block_tokens) * (shape.nixl_regions
                                                                    or shape.layers)


# Fitted constants, by column: (model, "fixed") ms and (model, "inverse") = 1 / efficiency per
# model family on its GPU; ("link", "latency") ms a read and ("link", "block") ms a block per
# interconnect; ("host", "descriptor") ms of the prefill's host work per descriptor a read
# posts (its preparation, before NIXL's transfer clock starts).
Column = tuple[str, str]
LINK_COLUMNS: tuple[Column, ...] = (("link", "latency"), ("link", "block"))
HOST_DESCRIPTOR: Column = ("host", "descriptor")


@dataclass(frozen=True)
class Constants:
    """Fitted constants by column (see :data:`LINK_COLUMNS` and the module docstring)."""

    values: dict[Column, float]

    def efficiency(self, model: str) -> float:
        return 1.0 / self.values[(model, "inverse")]

    def fixed_ms(self, model: str) -> float:
        return self.values[(model, "fixed")]

    @property
    def block_ms(self) -> float:
        """What one more block adds to a read."""
        return self.values[("link", "block")]

    @property
    def descriptor_ms(self) -> float:
        """What one more posted descriptor adds to a pulling prefill, outside the read."""
        return self.values[HOST_DESCRIPTOR]


# One published (or predicted) quantity: which model, what, and at which mean turn.
@dataclass(frozen=True)
class Point:
    """A quantity at a mean turn: ``prefill_off``, ``prefill_on`` or ``transfer``."""

    model: str
    quantity: str
    prompt_tokens: float  # mean prompt (OFF: all computed)
    computed_on_tokens: float  # mean computed with the feature ON
    pull_share: float
    read_blocks: float  # whole blocks per read
    published_ms: float
    label: str
    # The sweep's turns, each priced on its own (a published figure is their mean): empty to
    # price the mean turn above.
    turns: tuple[TurnShape, ...] = ()
    # Tokens a read moves (0: its whole blocks, read_blocks x 16).
    pulled_tokens: float = 0.0


def _checked(ms: float, what: str) -> float:
    if ms < 0:
        raise NegativeTimeError(f"{what}: {ms:.1f} ms is below zero")
    return ms


def read_terms(blocks: float) -> dict[Column, float]:
    """One D→P read of ``blocks`` whole blocks: its latency, and a cost per block (module
    docstring: the published reads cost the same per block whatever the model's descriptors
    or bytes)."""
    return {("link", "latency"): 1.0, ("link", "block"): blocks}


def wire_ms(engine: Engine, blocks: float, block_size: int = 16,
            link_bytes_per_s: float = EFA_P5EN_BYTES_PER_S) -> float:
    """The bytes of one read at the node's link rate: a floor under the read, not fitted.

    Each of the engine's ``TP`` ranks reads its own part: a sharded GQA cache moves ``1 / TP``
    of the bytes per rank, an MLA latent cache (one KV head) is replicated on every rank and
    moves whole; the node's link is shared by its ranks."""
    model, tp = engine.model, engine.tensor_parallel_size
    total = blocks * block_size * model.kv_bytes_per_token
    per_rank = total if model.kv_heads < tp else total / tp
    return 1000.0 * per_rank * tp / link_bytes_per_s


def terms(engine: Engine, point: Point) -> dict[Column, float]:
    """The coefficients of ``point``'s prediction: its time = Σ coefficient × constant.

    With ``point.turns``, the mean of each turn's coefficients: the attention's quadratic term
    is not linear in the tokens, so the mean turn's cost is not the
    turns' mean cost (a chat's first turn computes its whole prompt, the others ~150 tokens).
    The model stays linear in its constants either way."""
    if not point.turns:
        return _mean_turn_terms(engine, point)
    total: dict[Column, float] = {}
    reads = [t for t in point.turns if t.pulled_tokens]
    if point.quantity == "transfer":
        shapes, weight = reads, 1.0 / max(len(reads), 1)  # the mean per read
    else:
        shapes, weight = list(point.turns), 1.0 / len(point.turns)
    for turn in shapes:
        one = Point(point.model, point.quantity, turn.prompt_tokens, turn.computed_on_tokens,
                    1.0 if turn.pulled_tokens else 0.0, turn.read_blocks, point.published_ms,
                    point.label, pulled_tokens=turn.pulled_tokens)
        for column, value in _mean_turn_terms(engine, one).items():
            total[column] = total.get(column, 0.0) + weight * value
    return total


def _mean_turn_terms(engine: Engine, point: Point) -> dict[Column, float]:
    read = read_terms(point.read_blocks)
    if point.quantity == "transfer":
        return read
    name = point.model
    if point.quantity == "prefill_off":
        return {(name, "fixed"): 1.0,
                (name, "inverse"): engine.prefill_ideal_ms(point.prompt_tokens, 0.0)}
    context = point.prompt_tokens - point.computed_on_tokens
    out = {(name, "fixed"): 1.0,
           (name, "inverse"): engine.prefill_ideal_ms(point.computed_on_tokens, context)}
    if point.pull_share:
        out.update({column: point.pull_share * v for column, v in read.items()})
        pulled = point.pulled_tokens or 16.0 * point.read_blocks
        out[HOST_DESCRIPTOR] = point.pull_share * engine.descriptors(pulled)
    return out


def predict(engines: dict[str, Engine], constants: Constants, point: Point) -> float:
    """``point``'s time under ``constants``; NegativeTimeError below zero."""
    ms = sum(v * constants.values[c] for c, v in terms(engines[point.model], point).items())
    return _checked(ms, f"{point.model} {point.label}")


def fit(engines: dict[str, Engine], points: Sequence[Point]) -> Constants:
    """Least squares on relative errors over ``points``; an error when the points do not
    determine every constant they involve."""
    rows = [(terms(engines[p.model], p), p.published_ms) for p in points]
    columns = sorted({c for row, _ in rows for c in row})
    matrix = [[row.get(c, 0.0) / ms for c in columns] for row, ms in rows]
    width = len(columns)
    normal = [[sum(r[i] * r[j] for r in matrix) for j in range(width)] for i in range(width)]
    rhs = [sum(r[i] for r in matrix) for i in range(width)]  # every target is 1 (relative)
    solution = solve_linear(normal, rhs)
    if solution is None:
        raise ValueError("the points do not determine every constant")
    return Constants(dict(zip(columns, solution, strict=True)))


def published_engines() -> dict[str, Engine]:
    """The published runs' engines: each model on 8 × H200, TP 8."""
    return {name: Engine(MODELS[name], GPUS["h200-141gb"], 8) for name in FITTED}


@functools.cache
def published_fit() -> Constants:
    """The constants fitted on every published point (what :func:`cost_profile` prices with)."""
    return fit(published_engines(), published_points())


def cost_profile(model: str | ModelShape, gpu: str = "h200-141gb", tensor_parallel_size: int = 8,
                 constants: Constants | None = None) -> CostProfile:
    """The simulator's timing for ``model`` on ``tensor_parallel_size`` × ``gpu``, priced by
    this model (``kvscope simulate --cost-model physics``).

    The physics is linear in the tokens as :class:`~kvscope.emulator.cost_model.CostProfile`
    is, so each of its constants is a product of the work and the fitted constants:

    * prefill: fixed ms + the weights' read, a linear and an attention term per computed token,
      all over the fitted efficiency; a pull adds the host's work per descriptor, spread per
      pulled token (blocks × regions, without the last block's rounding);
    * a read: the link's latency and its per-block cost as bytes per ms;
    * decode, and the first token, one step at the HBM floor: the weights a token routes
      through (MoE: the active ones) plus the context's KV, read once at the GPUs' bandwidth.
      No TPOT was published to fit an efficiency to, so this is the floor, not a calibration;
      the published TTFT − prefill gaps (34-46 ms) are far above it and nothing here models
      the D leg's other costs.

    The efficiencies were fitted on 8 × H200: another GPU or TP is the same efficiency applied
    to its limits, an extrapolation."""
    if isinstance(model, str):
        if model not in FITTED:
            raise KeyError(f"no physics for model {model!r}; known: {', '.join(FITTED)}")
        model = MODELS[model]
    if model.family not in FITTED:
        raise KeyError(f"{model.name}: no fitted family {model.family!r} to borrow an "
                       f"efficiency from; known: {', '.join(FITTED)}")
    if gpu not in GPUS:
        raise KeyError(f"unknown GPU {gpu!r}; known: {', '.join(GPUS)}")
    c = constants or published_fit()
    engine = Engine(model, GPUS[gpu], tensor_parallel_size)
    shape, family = model, model.family
    inverse = c.values[(family, "inverse")]
    per_flop_ms = 1000.0 / engine.peak_flops * inverse
    hbm = engine.gpu.hbm_bytes_per_s * tensor_parallel_size
    # Each GPU reads its share of the context's KV (a replicated head or latent whole).
    kv_read_bytes = shape.kv_bytes_per_token_per_gpu(tensor_parallel_size) * tensor_parallel_size
    weights_ms = 1000.0 * shape.weights_bytes / hbm
    # One decode step of one sequence reads the weights its token routes through (MoE: the
    # active parameters) and its context's KV.
    step_ms = 1000.0 * shape.active_parameters * shape.weight_bytes / hbm
    step_per_context_ms = 1000.0 * kv_read_bytes / hbm
    block_size = 16
    descriptor_ms = c.values.get(HOST_DESCRIPTOR, 0.0)
    return CostProfile(
        name=f"{shape.name}-physics",
        kv_bytes_per_token=shape.kv_bytes_per_token,
        prefill_fixed_ms=c.values[(family, "fixed")] + weights_ms * inverse,
        prefill_ms_per_token=2.0 * shape.active_parameters * per_flop_ms,
        prefill_ms_per_token_context=4.0 * shape.layers * shape.attention_dim * per_flop_ms,
        load_ms_per_pulled_token=((shape.nixl_regions or shape.layers) / shape.kv_block_tokens
                                  * descriptor_ms),
        transfer_latency_ms=c.values[("link", "latency")],
        transfer_bytes_per_ms=block_size * shape.kv_bytes_per_token / c.block_ms,
        first_token_fixed_ms=step_ms,
        first_token_ms_per_prompt_token=step_per_context_ms,
        decode_ms_per_token=step_ms,
        decode_ms_per_token_context=step_per_context_ms,
        block_size=block_size)


def published_points(block_size: int = 16) -> list[Point]:
    """The sweep's published prefill (OFF, ON) and transfer figures at both ends, each at the
    mean turn of the sweep's own workload (:func:`kvscope.emulator.cost_model.calibration`)."""
    from kvscope import published
    from kvscope.emulator.cost_model import calibration
    from kvscope.emulator.turn_mix import turn_shapes
    from kvscope.emulator.workloads import published_sweep

    out: list[Point] = []
    for sweep in published.SWEEPS:
        cal = calibration(sweep, block_size)
        for end, mix in enumerate(cal.mix):
            prefix = f"{cal.prompt_tokens[end] // 1000}k"
            common = (sweep.profile, mix.prompt_tokens, mix.computed_on_tokens, mix.pull_share,
                      mix.read_blocks)
            # The same turns calibration() averaged (the generator the simulator runs).
            turns = tuple(turn_shapes(published_sweep.generate(
                sweep.prompt_tokens[end], conversations=sweep.conversations,
                turns=sweep.turns, new_tokens=sweep.new_tokens,
                output_tokens=sweep.output_tokens, clients=sweep.clients,
                block_size=block_size)))
            out.append(Point(common[0], "prefill_off", *common[1:], cal.prefill_off_ms[end],
                             f"prefill OFF {prefix}", turns))
            out.append(Point(common[0], "prefill_on", *common[1:], cal.prefill_on_ms[end],
                             f"prefill ON {prefix}", turns))
            out.append(Point(common[0], "transfer", *common[1:], cal.transfer_on_ms[end],
                             f"transfer {prefix}", turns))
    return out


__all__ = ["Column", "Constants", "EFA_P5EN_BYTES_PER_S", "Engine", "FITTED", "FP8_FLOPS",
    "HOST_DESCRIPTOR", "LINK_COLUMNS", "NegativeTimeError", "Point", "cost_profile", "fit",
    "predict", "published_engines", "published_fit", "published_points", "read_terms", "terms",
    "wire_ms"]
