"""Which of a checker's fault candidates explains a wrong output: the fit rule that the fault catalogues'
users share (:mod:`course_utils.faults.gemm`, :mod:`course_utils.checkers.attention`)."""

from __future__ import annotations

import torch


class FaultFits:
    """Which of a checker's fault candidates explains a wrong output ``got`` (float64, on the CPU).

    ``add(hint, candidate)`` returns True when the candidate is within (``atol``, ``rtol``) of ``got`` at every
    element (where ``where`` is True). ``best()`` is the hint of the closest such candidate (the smallest mean
    absolute difference: two fault forms, say two GELU approximations 0.02 apart, can both sit inside a float32
    GEMM's tolerance, and the closer one is the fault), else of a candidate that *nearly* fits: outside the
    tolerance at no more than ``near_share`` of the elements and at most a tenth as many as the right answer
    ``right`` (TF32 dot products on a GPU round the scores, and a fault that sharpens the softmax amplifies that
    rounding past the tolerance at a few elements), else ''."""

    NEAR_SHARE = 0.01

    def __init__(self, got: torch.Tensor, atol: float, rtol: float, where: torch.Tensor | None = None,
                 right: torch.Tensor | None = None, near_share: float = NEAR_SHARE):
        self.got, self.atol, self.rtol = got, atol, rtol
        self.where = where
        self.near_share = near_share
        self.fits: list[tuple[float, str]] = []
        self.near: list[tuple[float, str]] = []
        self.right_share = 1.0 if right is None else self._outside(right)[0]

    def _sel(self, t: torch.Tensor) -> torch.Tensor:
        return t if self.where is None else t[self.where]

    def _outside(self, candidate: torch.Tensor) -> tuple[float, float]:
        """(share of the elements outside the tolerance, mean absolute difference where both are finite)."""
        g, c = self._sel(self.got), self._sel(candidate.to(self.got.dtype))
        ok = torch.isclose(g, c, atol=self.atol, rtol=self.rtol, equal_nan=True)
        finite = torch.isfinite(g) & torch.isfinite(c)
        diff = float((g[finite] - c[finite]).abs().mean()) if bool(finite.any()) else 0.0
        return 1.0 - float(ok.double().mean()) if ok.numel() else 0.0, diff

    def add(self, hint: str, candidate: torch.Tensor | None) -> bool:
        if candidate is None:
            return False
        share, diff = self._outside(candidate)
        if share == 0.0:
            self.fits.append((diff, hint))
            return True
        if share <= self.near_share and share <= self.right_share / 10:
            self.near.append((share, hint))
        return False

    def best(self) -> str:
        for found in (self.fits, self.near):
            if found:
                return min(found, key=lambda f: f[0])[1]   # min keeps the first of equals: the order given
        return ""
