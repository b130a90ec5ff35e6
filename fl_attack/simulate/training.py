"""Local training of one Flower client over its dataset indices: FedSGD, FedAvg or DP-SGD (Opacus).

FedSGD and FedAvg step through :func:`fl_attack.simulate.local_sgd.sgd_steps`, the same loop
as :func:`fl_attack.simulate.victims.fedavg_update`; they differ from it only in drawing
their batches from a numpy generator over the client's indices. DP-SGD runs Opacus' own
engine (Poisson sampling, noise on every parameter), which
:func:`fl_attack.simulate.victims.dp_sgd_gradient` reproduces for one step of the first
layer only.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from .local_sgd import sgd_steps
from .opacus_keys import OPACUS_PREFIX, canonical_key

__all__ = [
    "OPACUS_PREFIX",
    "TrainOutcome",
    "evaluate_model",
    "strip_opacus_prefix",
    "train_dpsgd",
    "train_fedavg",
    "train_fedsgd",
]


@dataclass(frozen=True)
class TrainOutcome:
    """Result of one client's local training.

    Attributes
    ----------
    state_dict : dict[str, torch.Tensor]
        Trained parameters under the original model's keys (no ``_module.``).
    num_examples : int
        Number of examples the update is based on (FedAvg's weight).
    sample_indices : list[int]
        Dataset indices of the samples used, in order of first use, without duplicates.
    loss : float
        Mean training loss over the local steps.
    steps : int
        Number of optimizer steps.
    """

    state_dict: dict[str, torch.Tensor]
    num_examples: int
    sample_indices: list[int]
    loss: float
    steps: int


def strip_opacus_prefix(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove Opacus' ``_module.`` prefixes so keys match the unwrapped model.

    Keys are stripped by :func:`fl_attack.simulate.opacus_keys.canonical_key`, the same rule
    the server applies; the values are detached copies.
    """
    return {canonical_key(key): value.detach().clone() for key, value in state_dict.items()}


def _loss(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(inputs), labels)


def train_fedsgd(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: np.ndarray,
    *,
    batch_size: int,
    lr: float,
    rng: np.random.Generator,
) -> TrainOutcome:
    """One SGD step on one random batch of the client's data (FedSGD).

    Parameters
    ----------
    model : torch.nn.Module
        The global model; trained in place.
    images, labels : torch.Tensor
        The whole dataset, ``(N, ...)`` and ``(N,)``.
    indices : numpy.ndarray
        The client's dataset indices.
    batch_size : int
        Samples in the batch (all of the client's data if it holds fewer).
    lr : float
        Learning rate of the step.
    rng : numpy.random.Generator
        Draws the batch; seed it per round so each round uses a different batch.

    Returns
    -------
    TrainOutcome
    """
    chosen = rng.choice(indices, size=min(batch_size, len(indices)), replace=False)
    batch = torch.as_tensor(chosen, dtype=torch.long)
    model.train()
    (loss,) = sgd_steps(model, images, labels, batches=[batch], lr=lr)
    return TrainOutcome(
        state_dict=strip_opacus_prefix(model.state_dict()),
        num_examples=len(chosen),
        sample_indices=[int(index) for index in chosen],
        loss=loss,
        steps=1,
    )


def train_fedavg(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: np.ndarray,
    *,
    epochs: int,
    mini_batch_size: int,
    lr: float,
    rng: np.random.Generator,
) -> TrainOutcome:
    """Several local epochs of mini-batch SGD over the client's data (FedAvg).

    Parameters
    ----------
    model : torch.nn.Module
        The global model; trained in place.
    images, labels : torch.Tensor
        The whole dataset.
    indices : numpy.ndarray
        The client's dataset indices.
    epochs : int
        Passes over the local data, each in a fresh random order.
    mini_batch_size : int
        Samples per step (the last step of an epoch may be smaller).
    lr : float
        Learning rate.
    rng : numpy.random.Generator
        Draws the order of every epoch.

    Returns
    -------
    TrainOutcome
    """
    batches: list[torch.Tensor] = []
    used: dict[int, None] = {}
    for _ in range(epochs):
        order = rng.permutation(indices)
        for start in range(0, len(order), mini_batch_size):
            chunk = order[start : start + mini_batch_size]
            batches.append(torch.as_tensor(chunk, dtype=torch.long))
            used.update(dict.fromkeys(int(index) for index in chunk))
    model.train()
    losses = sgd_steps(model, images, labels, batches=batches, lr=lr)
    return TrainOutcome(
        state_dict=strip_opacus_prefix(model.state_dict()),
        num_examples=len(indices),
        sample_indices=list(used),
        loss=float(np.mean(losses)) if losses else math.nan,
        steps=len(losses),
    )


def train_dpsgd(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    indices: np.ndarray,
    *,
    epochs: int,
    mini_batch_size: int,
    lr: float,
    noise_multiplier: float,
    max_grad_norm: float,
    poisson_sampling: bool,
    seed: int,
) -> TrainOutcome:
    """DP-SGD over the client's data with Opacus.

    Each step clips every per-sample gradient to ``max_grad_norm``, sums them, adds
    Gaussian noise of std ``noise_multiplier * max_grad_norm`` and divides by the
    expected batch size. With Poisson sampling every sample joins each step
    independently with probability ``mini_batch_size / len(indices)``, so the batch
    size varies (and may be zero).

    Parameters
    ----------
    model : torch.nn.Module
        The global model; trained in place (Opacus wraps it for the duration).
    images, labels : torch.Tensor
        The whole dataset.
    indices : numpy.ndarray
        The client's dataset indices.
    epochs : int
        Passes over the local data.
    mini_batch_size : int
        (Expected) samples per step.
    lr : float
        Learning rate.
    noise_multiplier : float
        Noise std relative to ``max_grad_norm``.
    max_grad_norm : float
        Per-sample clipping norm.
    poisson_sampling : bool
        Poisson sampling (True) or shuffled fixed-size batches (False).
    seed : int
        Seeds batch sampling and the noise.

    Returns
    -------
    TrainOutcome
        ``state_dict`` under the original model's keys (``_module.`` stripped).
    """
    from opacus import PrivacyEngine  # pylint: disable=import-outside-toplevel

    positions = torch.as_tensor(np.asarray(indices), dtype=torch.long)
    dataset = TensorDataset(images[positions], labels[positions], positions)
    generator = torch.Generator().manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=mini_batch_size, shuffle=not poisson_sampling, generator=generator
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        engine = PrivacyEngine(accountant="rdp", secure_mode=False)
        private_model, private_optimizer, private_loader = engine.make_private(
            module=model,
            optimizer=optimizer,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=poisson_sampling,
            noise_generator=torch.Generator().manual_seed(seed + 1),
        )
    private_model.train()
    losses: list[float] = []
    used: dict[int, None] = {}
    steps = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(epochs):
            for inputs, targets, batch_indices in private_loader:
                private_optimizer.zero_grad(set_to_none=True)
                if len(targets):
                    loss = _loss(private_model, inputs, targets)
                    losses.append(float(loss.detach()))
                    used.update(dict.fromkeys(int(index) for index in batch_indices))
                else:
                    # An empty Poisson batch: the step is pure noise.
                    loss = private_model(inputs).sum()
                torch.autograd.backward(loss)
                private_optimizer.step()
                steps += 1
    state = strip_opacus_prefix(private_model.state_dict())
    return TrainOutcome(
        state_dict=state,
        num_examples=len(indices),
        sample_indices=list(used),
        loss=float(np.mean(losses)) if losses else math.nan,
        steps=steps,
    )


def evaluate_model(
    model: nn.Module, images: torch.Tensor, labels: torch.Tensor, indices: np.ndarray
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on the given samples."""
    batch = torch.as_tensor(np.asarray(indices), dtype=torch.long)
    model.eval()
    with torch.no_grad():
        logits = model(images[batch])
        loss = nn.functional.cross_entropy(logits, labels[batch])
        accuracy = (logits.argmax(dim=1) == labels[batch]).double().mean()
    return float(loss), float(accuracy)
