"""Solving the small linear systems behind kvscope's cost models (emulator profiles, what-if fit).

Pure Python: the systems are 2-4 unknowns, so NumPy would cost more to import than to use.
"""

from __future__ import annotations


def solve_linear(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """Solve a small square system (Gauss-Jordan, partial pivoting); None when singular."""
    n = len(rhs)
    m = [row[:] + [r] for row, r in zip(matrix, rhs, strict=True)]
    scale = max((abs(m[i][i]) for i in range(n)), default=0.0)
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) <= 1e-10 * max(scale, 1e-300):
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [x - k * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][n] / m[i][i] for i in range(n)]


__all__ = ["solve_linear"]
