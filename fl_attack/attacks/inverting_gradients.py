"""Optimization-based baseline: "Inverting Gradients" (Geiping et al., NeurIPS 2020).

The approximate attack that SPEAR (Table 1) compares against, in the "modern" configuration of
the ``breaching`` library: dummy inputs are optimized with Adam so that the gradient they
induce on the *whole* model matches the observed one in cosine similarity, regularized by
the total variation of the images. The labels are known to the attacker, the gradient steps
are signed, the inputs are boxed to the valid normalized pixel range, the learning rate
drops tenfold at 3/8, 5/8 and 7/8 of the iterations, and of several random restarts the one
whose gradients match best is kept.

Unlike SPEAR it needs the full gradient of every parameter, the labels and an image prior,
and it is never exact: it is here so that benchmarks can run it on the same gradients.
"""

from __future__ import annotations

import copy
import functools
import logging
import math
import operator
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fl_attack.pipeline.budget.budget import Budget, Deadline
from fl_attack.reconstruction import Reconstruction
from fl_attack.simulate.gradients import LOSSES
from fl_attack.types import ArrayLike, resolve_device

from .inverting_gradients_inputs import (
    GradientsLike,
    check_budget,
    check_labels,
    check_shape,
    gradient_list,
    input_box,
)

__all__ = ["InvertingGradients", "cosine_matching_loss", "total_variation"]

logger = logging.getLogger(__name__)

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

#: Iterations timed at the start of each restart to fit the schedule into a time budget.
_PROBE_ITERATIONS = 10


def _added(values: Iterable[torch.Tensor]) -> torch.Tensor:
    """Sum of (at least one) tensors, added left to right as the builtin ``sum`` does."""
    total: torch.Tensor = functools.reduce(operator.add, values)
    return total


def cosine_matching_loss(candidate: Sequence[torch.Tensor], target: Sequence[torch.Tensor]) -> torch.Tensor:
    """``1 - cos`` between two gradients, each the concatenation of all parameters' gradients.

    Parameters
    ----------
    candidate, target
        Per-parameter gradients in the same order and of the same shapes.

    Returns
    -------
    torch.Tensor
        Scalar in ``[0, 2]``; 0 when the gradients are parallel.
    """
    dot = _added((c * t).sum() for c, t in zip(candidate, target, strict=True))
    norm_c = torch.sqrt(_added(c.pow(2).sum() for c in candidate))
    norm_t = torch.sqrt(_added(t.pow(2).sum() for t in target))
    return 1.0 - dot / (norm_c * norm_t).clamp_min(torch.finfo(norm_t.dtype).tiny)


def total_variation(images: torch.Tensor) -> torch.Tensor:
    """Anisotropic total variation: mean ``|dx|`` plus mean ``|dy|`` of ``(B, C, H, W)`` images."""
    tv = images.new_zeros(())
    if images.shape[-2] > 1:
        tv = tv + (images[..., 1:, :] - images[..., :-1, :]).abs().mean()
    if images.shape[-1] > 1:
        tv = tv + (images[..., :, 1:] - images[..., :, :-1]).abs().mean()
    return tv


@dataclass
class _Adam:
    """Plain Adam on one tensor (torch.optim's construction alone costs seconds on first use)."""

    param: torch.Tensor
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8

    def __post_init__(self) -> None:
        self.steps = 0
        self.first = torch.zeros_like(self.param)
        self.second = torch.zeros_like(self.param)

    def step(self, grad: torch.Tensor, lr: float) -> None:
        beta1, beta2 = self.betas
        self.steps += 1
        self.first.mul_(beta1).add_(grad, alpha=1 - beta1)
        self.second.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        corrected_first = self.first / (1 - beta1**self.steps)
        denominator = (self.second / (1 - beta2**self.steps)).sqrt_().add_(self.eps)
        self.param.addcdiv_(corrected_first, denominator, value=-lr)


@dataclass
class _Problem:
    """One validated ``invert`` call: the model copy, the target gradient and the constraints."""

    model: nn.Module
    params: list[torch.Tensor]
    target: list[torch.Tensor]
    labels: torch.Tensor
    shape: tuple[int, ...]
    low: torch.Tensor | None
    high: torch.Tensor | None
    loss_fn: LossFn

    def matching_loss(self, x: torch.Tensor, *, create_graph: bool) -> torch.Tensor:
        """``1 - cos`` between the gradient that ``x`` induces and the observed one."""
        loss = self.loss_fn(self.model(x), self.labels)
        grads = torch.autograd.grad(loss, self.params, create_graph=create_graph)
        return cosine_matching_loss(grads, self.target)


@dataclass
class _Restart:
    inputs: torch.Tensor
    matching_loss: float
    initial_matching_loss: float
    iterations: int


class InvertingGradients:
    """Geiping et al. (2020) gradient inversion by cosine gradient matching with a TV prior.

    Defaults follow the "modern" ``invertinggradients`` configuration of the breaching library
    used by SPEAR's Table 1: Adam with step 0.1 on signed gradients, 24,000 iterations with a
    tenfold learning-rate drop at 3/8, 5/8 and 7/8 of them, total-variation weight 0.2,
    standard-normal initialization, inputs boxed to the valid pixel range, one restart.

    Parameters
    ----------
    iterations
        Optimization steps per restart (fewer when a time budget forces it: the schedule is
        then compressed so that its learning-rate drops still happen).
    lr
        Initial Adam step size.
    tv_weight
        Weight of the total-variation prior; applied only to image inputs
        (``input_shape`` of length 3). 0 disables it.
    restarts
        Independent random initializations; the one with the lowest final gradient-matching
        loss (without the prior) is returned.
    signed
        Step on the sign of the input gradient ("hard" signed gradients of breaching).
    boxed
        Clamp the inputs after every step to the normalized image of the pixel range
        ``[0, 1]``: ``[(0 - mean) / std, (1 - mean) / std]`` per channel.
    milestones
        Fractions of the iterations at which the learning rate is multiplied by ``lr_decay``.
    lr_decay
        Learning-rate factor at each milestone.
    loss
        The client's training loss: a name of :data:`fl_attack.simulate.victims.LOSSES` (``"ce"``: mean
        cross-entropy, ``"mse"``) or a callable ``(logits, labels) -> scalar``.
    seed
        Seed of the initializations; the same seed on the same device gives the same result.
        None draws fresh randomness.
    device
        ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or a ``torch.device``.
    time_budget
        Seconds for the whole call, shared equally by the restarts; None for no limit.

    Raises
    ------
    ValueError
        On a non-positive iteration count, step size, restart count or budget, a negative TV
        weight, milestones outside ``(0, 1)``, or an unknown loss name.
    """

    name = "inverting-gradients"

    def __init__(
        self,
        *,
        iterations: int = 24_000,
        lr: float = 0.1,
        tv_weight: float = 0.2,
        restarts: int = 1,
        signed: bool = True,
        boxed: bool = True,
        milestones: Sequence[float] = (3 / 8, 5 / 8, 7 / 8),
        lr_decay: float = 0.1,
        loss: str | LossFn = "ce",
        seed: int | None = 0,
        device: str | torch.device = "auto",
        time_budget: float | None = None,
    ) -> None:
        if not isinstance(iterations, int) or iterations < 1:
            raise ValueError(f"iterations must be a positive integer, got {iterations!r}")
        if not lr > 0:
            raise ValueError(f"lr must be positive, got {lr}")
        if not tv_weight >= 0:
            raise ValueError(f"tv_weight must be >= 0, got {tv_weight}")
        if not isinstance(restarts, int) or restarts < 1:
            raise ValueError(f"restarts must be a positive integer, got {restarts!r}")
        if any(not 0 < f < 1 for f in milestones):
            raise ValueError(f"milestones must be fractions in (0, 1), got {tuple(milestones)}")
        if not 0 < lr_decay <= 1:
            raise ValueError(f"lr_decay must be in (0, 1], got {lr_decay}")
        if isinstance(loss, str) and loss not in LOSSES:
            raise ValueError(f"unknown loss {loss!r}; available: {sorted(LOSSES)}")
        check_budget(time_budget)
        self.iterations = iterations
        self.lr = float(lr)
        self.tv_weight = float(tv_weight)
        self.restarts = restarts
        self.signed = signed
        self.boxed = boxed
        self.milestones = tuple(sorted(float(f) for f in milestones))
        self.lr_decay = float(lr_decay)
        self.loss = loss
        self.seed = seed
        self.device = device
        self.time_budget = time_budget

    def invert(
        self,
        gradients: GradientsLike,
        *,
        model: nn.Module,
        labels: ArrayLike | Sequence[int],
        input_shape: Sequence[int],
        data_mean: Sequence[float] | None = None,
        data_std: Sequence[float] | None = None,
        batch_size: int | None = None,
        budget: Budget | None = None,
    ) -> Reconstruction:
        """Reconstruct a batch from the gradient of every model parameter.

        Parameters
        ----------
        gradients
            The client's gradient of its mean batch loss: one tensor or array per parameter,
            either a sequence in the order of ``model.parameters()`` or a mapping from the
            names of ``model.named_parameters()``. Cosine matching is invariant to the
            gradient's scale but not to its sign: pass ``(W_old - W_new) / lr`` for a FedSGD
            weight update, not the update itself.
        model
            The model at the parameters where the gradient was taken; not modified (a copy
            is optimized against).
        labels
            ``(b,)`` integer labels of the batch (the attack assumes they are known, as in
            SPEAR's comparison).
        input_shape
            Shape of one model input, e.g. ``(C, H, W)``; the dummy batch is ``(b, *input_shape)``.
        data_mean, data_std
            Per-channel (or single) normalization of the inputs, ``x = (pixel - mean) / std``.
            They set the box of valid inputs; both None means the inputs are pixels in
            ``[0, 1]`` themselves.
        batch_size
            The batch size, if known separately; must equal ``len(labels)``.
        budget
            The attack's time budget, already started (None: the constructor's ``time_budget``,
            from this call).

        Returns
        -------
        Reconstruction
            ``inputs`` ``(b, prod(input_shape))`` float64 CPU, rows roughly in label order;
            ``sparsity_matching`` is NaN (the attack has no sparsity structure);
            ``complete`` is always False (the attack is approximate); ``confidence`` repeats the
            final gradient cosine similarity (clamped to ``[0, 1]``) for every sample, since the
            attacker cannot tell which rows are right; ``stats`` holds the final and initial
            ``matching_loss`` (``1 - cos``), ``cosine_similarity``, ``iterations`` of the kept
            restart, ``restart_losses`` and ``stopped_by``.

        Raises
        ------
        ValueError
            On missing, extra, misshapen, NaN/Inf or all-zero gradients, labels that are not
            ``b`` integers within the model's outputs, a ``batch_size`` that disagrees with
            them, a bad ``input_shape`` or normalization, or a model that rejects the inputs.
        """
        budget = Budget.start(self.time_budget) if budget is None else budget
        deadline = budget.deadline
        device = resolve_device(self.device)
        problem = self._prepare(
            gradients,
            model=model,
            labels=labels,
            input_shape=input_shape,
            data_mean=data_mean,
            data_std=data_std,
            batch_size=batch_size,
            device=device,
        )
        generator = torch.Generator().manual_seed(self.seed if self.seed is not None else torch.seed())
        runs: list[_Restart] = []
        stopped_by = "iterations"
        for index in range(self.restarts):
            left = deadline.remaining()
            if runs and left <= 0:
                stopped_by = "time_budget"
                break
            runs.append(
                self._restart(problem, generator, Deadline.in_seconds(left / (self.restarts - index)))
            )
            if runs[-1].iterations < self.iterations:
                stopped_by = "time_budget"
        best = min(runs, key=lambda run: run.matching_loss)
        cosine = 1.0 - best.matching_loss
        b = problem.labels.shape[0]
        elapsed = budget.elapsed()
        stats: dict[str, Any] = {
            "attack": self.name,
            "matching_loss": best.matching_loss,
            "initial_matching_loss": best.initial_matching_loss,
            "cosine_similarity": cosine,
            "iterations": best.iterations,
            "planned_iterations": self.iterations,
            "restarts_run": len(runs),
            "restart_losses": [run.matching_loss for run in runs],
            "tv_applied": self._uses_tv(problem.shape),
            "stopped_by": stopped_by,
            "device": str(device),
        }
        logger.info(
            "%s: b=%d 1-cos=%.4g after %d iterations x %d restarts in %.1fs",
            self.name,
            b,
            best.matching_loss,
            best.iterations,
            len(runs),
            elapsed,
        )
        confidence = torch.full((b,), min(max(cosine, 0.0), 1.0), dtype=torch.float64)
        return Reconstruction(
            inputs=best.inputs.detach().reshape(b, -1).to(device="cpu", dtype=torch.float64),
            batch_size=b,
            sparsity_matching=math.nan,
            complete=False,
            confidence=confidence,
            seconds=elapsed,
            stats=stats,
        )

    # ------------------------------------------------------------------ optimization

    def _uses_tv(self, shape: tuple[int, ...]) -> bool:
        return self.tv_weight > 0 and len(shape) == 3

    def _restart(self, problem: _Problem, generator: torch.Generator, deadline: Deadline) -> _Restart:
        """One random initialization optimized until its iterations or its deadline run out."""
        dtype = problem.params[0].dtype
        device = problem.params[0].device
        b = problem.labels.shape[0]
        x = torch.randn((b, *problem.shape), generator=generator, dtype=dtype).to(device)
        self._clamp(x, problem)
        x.requires_grad_(True)
        use_tv = self._uses_tv(problem.shape)
        adam = _Adam(x)
        total = self.iterations
        boundaries = self._boundaries(total)
        started, seconds = time.perf_counter(), deadline.remaining()
        initial = math.nan
        done = 0
        for step in range(self.iterations):
            if step == _PROBE_ITERATIONS and deadline.bounded:
                per_step = (time.perf_counter() - started) / step
                fits = int(seconds / max(per_step, 1e-9))
                if fits < total:
                    total = max(step + 1, fits)
                    boundaries = self._boundaries(total)
            if step >= total or (step > 0 and deadline.expired()):
                break
            matching = problem.matching_loss(x, create_graph=True)
            if step == 0:
                initial = float(matching.detach())
            objective = matching
            if use_tv:
                objective = objective + self.tv_weight * total_variation(x)
            (grad,) = torch.autograd.grad(objective, x)
            if self.signed:
                grad = grad.sign()
            lr = self.lr * self.lr_decay ** sum(step >= boundary for boundary in boundaries)
            with torch.no_grad():
                adam.step(grad, lr)
                self._clamp(x, problem)
            done = step + 1
        final = float(problem.matching_loss(x, create_graph=False))
        if not math.isfinite(final):
            final = math.inf
        return _Restart(
            inputs=x.detach(), matching_loss=final, initial_matching_loss=initial, iterations=done
        )

    def _boundaries(self, total: int) -> list[int]:
        return [int(round(f * total)) for f in self.milestones]

    def _clamp(self, x: torch.Tensor, problem: _Problem) -> None:
        if problem.low is not None and problem.high is not None:
            with torch.no_grad():
                torch.maximum(x, problem.low, out=x)
                torch.minimum(x, problem.high, out=x)

    # ------------------------------------------------------------------ validation

    def _prepare(
        self,
        gradients: GradientsLike,
        *,
        model: nn.Module,
        labels: ArrayLike | Sequence[int],
        input_shape: Sequence[int],
        data_mean: Sequence[float] | None,
        data_std: Sequence[float] | None,
        batch_size: int | None,
        device: torch.device,
    ) -> _Problem:
        if not isinstance(model, nn.Module):
            raise ValueError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        shape = check_shape(input_shape)
        local = copy.deepcopy(model).to(device)
        named = list(local.named_parameters())
        if not named:
            raise ValueError("model has no parameters: there is no gradient to match")
        params = [p.requires_grad_(True) for _, p in named]
        dtype = params[0].dtype
        target = gradient_list(gradients, named, device=device, dtype=dtype)
        y = check_labels(labels, batch_size=batch_size, device=device)
        low, high = input_box(shape, data_mean, data_std, boxed=self.boxed, device=device, dtype=dtype)
        loss_fn = LOSSES[self.loss] if isinstance(self.loss, str) else self.loss
        probe = torch.zeros((y.shape[0], *shape), dtype=dtype, device=device)
        try:
            with torch.no_grad():
                logits = local(probe)
        except RuntimeError as exc:
            raise ValueError(f"the model rejects inputs of shape {tuple(probe.shape)}: {exc}") from exc
        if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
            raise ValueError(
                f"the model maps a batch {tuple(probe.shape)} to outputs {tuple(logits.shape)}; "
                f"expected ({y.shape[0]}, classes)"
            )
        if int(y.max()) >= logits.shape[1]:
            raise ValueError(f"labels must be < {logits.shape[1]} (the model's outputs), got {int(y.max())}")
        return _Problem(
            model=local,
            params=params,
            target=target,
            labels=y,
            shape=shape,
            low=low,
            high=high,
            loss_fn=loss_fn,
        )
