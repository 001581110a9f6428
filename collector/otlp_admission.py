"""Admission by bytes: the receiver's bound on the request bodies it holds at once.

Each OTLP request holds its body (and, when gzipped, the inflated body) in memory from the
moment it is read until it is answered, which, with acknowledgement after commit, is after its
rows are in the store. Bounding requests by rows did not bound memory (24 concurrent 60 MiB
one-span requests took the receiver to 4.9 GB), so :class:`ByteBudget` bounds the bytes of the
requests in flight, on both transports:

- OTLP/HTTP reserves bytes as the body arrives: at most :data:`UNRECEIVED_ALLOWANCE_BYTES`
  ahead of what it has received (never more than the ``Content-Length``), waiting up to
  :data:`ADMISSION_WAIT_S` in arrival order for each step. A slow or chunked upload so holds
  what it sent, not what it announced: two senders trickling 64 MiB bodies once held the whole
  128 MiB budget for 30 s and every other exporter got 503. The oldest request in flight grows
  without waiting (past ``limit`` if it must), so requests that each hold part of their body
  cannot wait for each other for ever: the bound is ``limit`` plus one request's size.
- OTLP/gRPC receives the message before its handler runs, so it reserves the message's size
  without waiting (a request is refused at once when the budget is full); the calls whose
  messages grpc reads at all are bounded before that (``otlp_grpc``'s slots: the others wait).
- A gzip body grows its reservation by the inflated size before it is inflated (see
  :meth:`Reservation.grow_to`).

A request that cannot be admitted is answered 503 with ``Retry-After`` (UNAVAILABLE with
``RetryInfo`` on gRPC), which the OTLP exporters retry. One request is always admitted when
nothing else is in flight, so a budget smaller than ``max_request_bytes`` slows large requests
down but never refuses them for ever.
"""

from __future__ import annotations

import asyncio
from collections import deque

# Longest an OTLP/HTTP request waits for room before it is answered 503 (Retry-After): shorter
# than the OTLP exporters' default 10 s timeout, so that they see the 503 and retry.
ADMISSION_WAIT_S = 5.0
# Most bytes an OTLP/HTTP request holds beyond what it has received (one step of reading).
UNRECEIVED_ALLOWANCE_BYTES = 1 << 20


class ByteBudget:
    """Bytes of request bodies in flight, at most ``limit`` (one request always fits alone).

    Lives on the receiver's event loop; not thread-safe. Waiters are served in arrival order,
    so a large request is not overtaken for ever by small ones.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        # (bytes, granted, the reservation growing or None for a new request), in order.
        self._waiters: deque[tuple[int, asyncio.Future[None], Reservation | None]] = deque()
        # Reservations holding bytes, oldest first (a dict keeps insertion order).
        self._holders: dict[Reservation, None] = {}

    def _fits(self, nbytes: int) -> bool:
        return self.in_flight == 0 or self.in_flight + nbytes <= self.limit

    def _take(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak = max(self.peak, self.in_flight)

    def try_acquire(self, nbytes: int) -> bool:
        """Take ``nbytes`` now if they fit and nobody waits before; True when taken."""
        if self._waiters or not self._fits(nbytes):
            return False
        self._take(nbytes)
        return True

    async def acquire(self, nbytes: int, wait_s: float,
                      owner: Reservation | None = None) -> bool:
        """Take ``nbytes``, waiting up to ``wait_s`` in arrival order; True when taken.

        ``owner``: the reservation these bytes grow; it is served at once when it becomes the
        oldest holder while waiting.
        """
        if self.try_acquire(nbytes):
            return True
        if wait_s <= 0:
            return False
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((nbytes, granted, owner))
        try:
            async with asyncio.timeout(wait_s):
                await asyncio.shield(granted)
        except TimeoutError:
            if granted.done():  # granted in the same instant: the bytes are ours
                return True
            granted.cancel()
            self._wake()
            return False
        except asyncio.CancelledError:
            if granted.done() and not granted.cancelled():
                self.release(nbytes)
            else:
                granted.cancel()
                self._wake()
            raise
        return True

    def release(self, nbytes: int) -> None:
        """Give back ``nbytes`` and admit the waiters that now fit, in order."""
        self.in_flight -= nbytes
        self._wake()

    def _wake(self) -> None:
        oldest = next(iter(self._holders), None)
        for entry in list(self._waiters):
            nbytes, granted, owner = entry
            if oldest is not None and owner is oldest and not granted.done():
                self._waiters.remove(entry)
                self._take(nbytes)
                granted.set_result(None)
        while self._waiters:
            nbytes, granted, _ = self._waiters[0]
            if granted.done():
                self._waiters.popleft()
                continue
            if not self._fits(nbytes):
                return
            self._waiters.popleft()
            self._take(nbytes)
            granted.set_result(None)

    def is_oldest(self, reservation: Reservation) -> bool:
        """Whether ``reservation`` is the oldest one holding bytes (it may grow at once)."""
        return next(iter(self._holders), None) is reservation

    def room(self) -> int:
        """Bytes that could be taken now without waiting (0 when somebody waits)."""
        if self._waiters:
            return 0
        return max(0, self.limit - self.in_flight)


class Reservation:
    """The bytes one request holds in a :class:`ByteBudget`; :meth:`close` gives them back."""

    def __init__(self, budget: ByteBudget, nbytes: int) -> None:
        self.budget = budget
        self.nbytes = nbytes
        budget._holders[self] = None

    async def grow(self, nbytes: int, wait_s: float) -> bool:
        """Hold ``nbytes`` in all, waiting up to ``wait_s`` in arrival order; True when held.

        The oldest reservation grows at once, even past the budget's limit: two requests each
        waiting for the bytes the other holds would otherwise wait until both time out.
        """
        extra = nbytes - self.nbytes
        if extra <= 0:
            return True
        budget = self.budget
        if budget.is_oldest(self):
            budget._take(extra)
        elif not await budget.acquire(extra, wait_s, self):
            return False
        self.nbytes += extra
        return True

    def shrink_to(self, nbytes: int) -> None:
        """Give back what this request holds beyond ``nbytes``."""
        if nbytes < self.nbytes:
            self.budget.release(self.nbytes - nbytes)
            self.nbytes = nbytes

    def grow_to(self, nbytes: int) -> int:
        """Hold up to ``nbytes`` without waiting; return what is held now (maybe less).

        Never waits while holding (two requests each waiting for the other's bytes would
        deadlock): it takes what is free now, all of it when this request is alone.
        """
        if nbytes <= self.nbytes:
            return self.nbytes
        budget = self.budget
        if budget.in_flight == self.nbytes and not budget._waiters:
            extra = nbytes - self.nbytes  # alone in flight: one request always fits
        else:
            extra = min(nbytes - self.nbytes, budget.room())
        if extra > 0:
            budget._take(extra)
            self.nbytes += extra
        return self.nbytes

    def close(self) -> None:
        """Give every byte back (idempotent)."""
        self.budget._holders.pop(self, None)
        nbytes, self.nbytes = self.nbytes, 0
        self.budget.release(nbytes)  # wakes waiters, the next oldest holder among them


__all__ = ["ADMISSION_WAIT_S", "ByteBudget", "Reservation", "UNRECEIVED_ALLOWANCE_BYTES"]
