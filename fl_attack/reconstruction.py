"""The result of one gradient-inversion attack."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from fl_attack.pipeline.selection.self_check import SelfCheck


@dataclass(frozen=True)
class Reconstruction:
    """Inputs recovered from one first-layer update, with what the attacker knows of their quality.

    Everything here is computed from the observed update alone: the attacker never sees
    the ground truth. Scoring against the ground truth is the job of :mod:`fl_attack.evaluation.metrics`.

    Attributes
    ----------
    inputs
        ``(batch_size, n)`` float64 CPU tensor, one recovered layer input per row, rows in an
        arbitrary order. When the attack is incomplete, rows that come from the orthonormal
        completion are placeholders and have ``confidence`` 0.
    batch_size
        The batch size used by the attack (estimated from the spectrum unless given).
    sparsity_matching
        The sparsity-matching coefficient lambda in [0, 1] of the whole reconstruction
        (SPEAR Def. 4.1); 1.0 means the ReLU pattern implied by ``inputs`` agrees everywhere
        with the zero pattern of the observed gradient.
    complete
        True when ``batch_size`` independent sparse directions were found, their ReLU
        patterns agree with the gradient and the attack's own self-check passed (see
        ``self_check``). On a clean gradient every sample must agree (confidence >= the
        attack's ``accept_matching``). On a noisy gradient (DP noise) agreement cannot be
        exact: ``complete`` says that all directions were found, that their mean matching
        is well above chance (``fl_attack.attacks.spear.NOISY_COMPLETE_MATCHING``; below it the
        measured reconstructions were noise) and that the self-check passed up to the noise.
        Where the patterns at ``W_0`` do not confirm a clean batch (several local epochs move
        them) but every row lies on one 8-bit pixel grid, the grid does
        (``self_check.certificate``, :mod:`fl_attack.pipeline.selection.pixel_grid`) and the
        rows are rounded to their exact pixels.
    confidence
        ``(batch_size,)`` float64 tensor: per-sample sparsity-matching coefficient, 0 for
        placeholder rows. Near 1 means the sample is consistent with the observed update. For
        an update fitted as one local epoch of mini-batches (``stats["local_epoch"]``), each
        sample's matching at the weights of its own step; 1 for rows certified by their pixel grid.
    seconds
        Wall-clock time of the attack.
    stats
        Diagnostics: initializations used, candidates, restarts, noise estimate, the time
        budget and whether it ran out, the self-check's figures, ...
    self_check
        The attack's check of its own result against the observed update alone
        (:class:`fl_attack.pipeline.selection.self_check.SelfCheck`), or None for attacks that make none;
        ``complete`` is never True when it failed.
    """

    inputs: torch.Tensor
    batch_size: int
    sparsity_matching: float
    complete: bool
    confidence: torch.Tensor
    seconds: float
    stats: dict[str, Any] = field(default_factory=dict)
    self_check: SelfCheck | None = None

    def __post_init__(self) -> None:
        if self.complete and self.self_check is not None and not self.self_check.passed:
            raise ValueError(
                "a reconstruction whose self-check failed cannot be complete: "
                + "; ".join(self.self_check.reasons)
            )

    @property
    def found(self) -> int:
        """Number of rows backed by a recovered sparse direction (not placeholders)."""
        return int(self.stats.get("directions_found", self.batch_size if self.complete else 0))

    def summary(self) -> dict[str, Any]:
        """A flat, JSON-serialisable summary (no tensors)."""
        return {
            "batch_size": self.batch_size,
            "sparsity_matching": float(self.sparsity_matching),
            "complete": bool(self.complete),
            "directions_found": self.found,
            "min_confidence": float(self.confidence.min()) if self.confidence.numel() else 0.0,
            "seconds": float(self.seconds),
            **{k: v for k, v in self.stats.items() if isinstance(v, (int, float, str, bool))},
        }
