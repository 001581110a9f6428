"""Fault switches for the emulated P/D servers: one named fault per miss cause, mixed by chance.

Each fault makes one miss cause of DESIGN §5 happen on purpose. A :class:`FaultMix` gives each
enabled fault a probability; whether a fault hits a turn is drawn from ``(seed, fault name,
turn key)`` alone, where the turn key is a hash of the turn's prompt tokens. The same seeded
workload therefore meets the same faults on every run, whatever the request ids, the arrival
order or the concurrency, and the prefill and decode legs of one turn (same prompt) agree.

Where each fault acts (leg) and the ground-truth outcome of turn k it produces. A failed read
(``expire_before_next_turn``, ``handshake_fail``, ``transfer_fail``, ``clock_skew``) reaches
vLLM's scheduler through ``failed_recving``: under ``kv_load_failure_policy=fail`` (vLLM's
default, the emulator's too) the turn ends in error → ``load_failed_errored``; under
``recompute`` its computed tokens are reset to 0, the unchanged offer is accepted again, no read
is registered, and it stalls → ``load_stalled``. The read's own status (``declined_expired``,
``handshake_failed``, ``failed``) is in the evidence.

- ``decode_no_bidir`` (decode): bidir off at D for turn k-1 → ``no_decode_metadata``.
- ``strip_stream_metadata`` (decode): D pins blocks, the stream omits ``kv_transfer_params``
  → ``no_decode_metadata`` (and D's blocks expire unread).
- ``expire_before_next_turn`` (decode): turn k-1 pinned with a tiny TTL: the read is declined.
- ``prefill_no_bidir`` (prefill): bidir off at P; a pull offer parks the request, which stalls
  → ``prefill_bidir_disabled``.
- ``invalid_params`` (prefill): ``remote_request_id`` removed from the offer → ``invalid_params``.
- ``handshake_fail`` (prefill): the NIXL handshake to D fails.
- ``transfer_fail`` (prefill): the NIXL READ fails.
- ``clock_skew`` (prefill): P misjudges D's clock by one TTL, the read is declined.
- ``preempt_after_read`` (prefill): P is preempted after its read → ``preempted`` (*).
- ``evict_prefix_cache`` (prefill): memory pressure empties P's prefix cache first (less local
  reuse: the pull covers more, or the turn recomputes).
- ``load_failure_policy_fail`` (prefill): ``kv_load_failure_policy=fail`` for this request (for a
  server run with ``recompute``); with a failing load → ``load_failed_errored``.

(*) with P's prefix cache off; with it on, the pulled blocks are cached and the reschedule
covers them locally (``reused_local``), as the reuse model says.

Decode-leg faults act on turn k-1's finish and so show up in turn k's outcome.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvscope.errors import SettingError

DECODE_NO_BIDIR = "decode_no_bidir"
PREFILL_NO_BIDIR = "prefill_no_bidir"
STRIP_STREAM_METADATA = "strip_stream_metadata"
TRANSFER_FAIL = "transfer_fail"
HANDSHAKE_FAIL = "handshake_fail"
EXPIRE_BEFORE_NEXT_TURN = "expire_before_next_turn"
EVICT_PREFIX_CACHE = "evict_prefix_cache"
PREEMPT_AFTER_READ = "preempt_after_read"
INVALID_PARAMS = "invalid_params"
CLOCK_SKEW = "clock_skew"
LOAD_FAILURE_POLICY_FAIL = "load_failure_policy_fail"
# Faults of the proxy and the client, which only the simulator (it plays both) injects.
NO_CONVERSATION_ID = "no_conversation_id"  # per conversation: the client sends no id
PROXY_RESTART = "proxy_restart"  # the router loses its entries before this turn

LEG_PREFILL = "prefill"
LEG_DECODE = "decode"


@dataclass(frozen=True)
class FaultSpec:
    """One named fault: which leg applies it and what it stands for."""

    name: str
    leg: str
    description: str


FAULTS: dict[str, FaultSpec] = {
    spec.name: spec
    for spec in (
        FaultSpec(DECODE_NO_BIDIR, LEG_DECODE,
                  "bidirectional_kv_xfer off at decode: no params, no retention"),
        FaultSpec(STRIP_STREAM_METADATA, LEG_DECODE,
                  "decode keeps the blocks but its stream carries no kv_transfer_params "
                  "(vLLM without PR #40186)"),
        FaultSpec(EXPIRE_BEFORE_NEXT_TURN, LEG_DECODE,
                  "decode pins the finished turn with a tiny TTL: expired before the next turn"),
        FaultSpec(PREFILL_NO_BIDIR, LEG_PREFILL,
                  "bidirectional_kv_xfer off at prefill: a pull offer parks the request"),
        FaultSpec(INVALID_PARAMS, LEG_PREFILL,
                  "the offer reaching prefill lacks remote_request_id"),
        FaultSpec(HANDSHAKE_FAIL, LEG_PREFILL, "the NIXL handshake from prefill to decode fails"),
        FaultSpec(TRANSFER_FAIL, LEG_PREFILL, "the NIXL READ from decode fails"),
        FaultSpec(CLOCK_SKEW, LEG_PREFILL,
                  "prefill misjudges decode's clock by one TTL: the read is declined as expired"),
        FaultSpec(PREEMPT_AFTER_READ, LEG_PREFILL, "prefill is preempted after its read"),
        FaultSpec(EVICT_PREFIX_CACHE, LEG_PREFILL,
                  "memory pressure empties prefill's prefix cache before the request"),
        FaultSpec(LOAD_FAILURE_POLICY_FAIL, LEG_PREFILL,
                  "kv_load_failure_policy=fail: a failed load ends the turn with an error"),
    )
}

# The header (and body field) naming faults for one request, honoured only when allowed.
FAULT_HEADER = "X-Kvscope-Fault"
FAULT_BODY_FIELD = "kvscope_fault"


def parse_fault(text: str) -> tuple[str, float]:
    """``NAME`` or ``NAME=P`` → (name, probability); SettingError naming the bad part."""
    name, sep, raw = text.partition("=")
    name = name.strip()
    if name not in FAULTS:
        raise SettingError(
            f"--fault {text!r}: unknown fault {name!r}; known: {', '.join(sorted(FAULTS))}"
        )
    if not sep:
        return name, 1.0
    try:
        probability = float(raw)
    except ValueError:
        raise SettingError(f"--fault {text!r}: probability {raw!r} is not a number") from None
    if not 0.0 <= probability <= 1.0:
        raise SettingError(f"--fault {text!r}: probability must be between 0 and 1")
    return name, probability


def names_in(value: object) -> frozenset[str]:
    """Fault names in a header value or body field (comma separated, or a list); unknown skipped."""
    if isinstance(value, str):
        items: Iterable[object] = value.split(",")
    elif isinstance(value, list | tuple):
        items = value
    else:
        return frozenset()
    return frozenset(s for s in (str(i).strip() for i in items) if s in FAULTS)


def turn_key(token_ids: Iterable[int]) -> int:
    """A stable 64-bit key of one prompt: the same prompt gets the same faults on every run."""
    digest = hashlib.blake2b(digest_size=8)
    for token in token_ids:
        digest.update(struct.pack("<I", token & 0xFFFFFFFF))
    return int.from_bytes(digest.digest(), "little")


def _uniform(seed: int, name: str, key: int) -> float:
    payload = struct.pack("<qQ", seed, key & 0xFFFFFFFFFFFFFFFF) + name.encode()
    value = int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little")
    return value / 2**64


@dataclass(frozen=True)
class FaultMix:
    """Enabled faults with their probabilities, drawn deterministically under ``seed``."""

    probabilities: Mapping[str, float] = field(default_factory=dict)
    seed: int = 0

    @classmethod
    def from_args(cls, specs: Iterable[str], seed: int = 0) -> FaultMix:
        """Build from repeated ``--fault NAME[=P]`` values (a repeated name keeps the last P)."""
        return cls(dict(parse_fault(s) for s in specs), seed)

    def draw(self, key: int, leg: str, extra: Iterable[str] = ()) -> frozenset[str]:
        """Faults that hit the ``leg`` of the turn with ``key``; ``extra`` always hit."""
        hit = {
            name
            for name, p in self.probabilities.items()
            if FAULTS[name].leg == leg and p > 0 and _uniform(self.seed, name, key) < p
        }
        hit.update(name for name in extra if FAULTS[name].leg == leg)
        return frozenset(hit)

    def describe(self) -> dict[str, float]:
        """The mix as plain data, for the run's recorded settings."""
        return dict(sorted(self.probabilities.items()))


__all__ = ["CLOCK_SKEW", "DECODE_NO_BIDIR", "EVICT_PREFIX_CACHE", "EXPIRE_BEFORE_NEXT_TURN",
    "FAULTS", "FAULT_BODY_FIELD", "FAULT_HEADER", "FaultMix", "FaultSpec", "HANDSHAKE_FAIL",
    "INVALID_PARAMS", "LEG_DECODE", "LEG_PREFILL", "LOAD_FAILURE_POLICY_FAIL", "NO_CONVERSATION_ID",
    "PREEMPT_AFTER_READ", "PREFILL_NO_BIDIR", "PROXY_RESTART", "STRIP_STREAM_METADATA",
    "TRANSFER_FAIL", "names_in", "parse_fault", "turn_key"]
