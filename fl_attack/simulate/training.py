"""Local training of one client: FedSGD, FedAvg or DP-SGD (Opacus)."""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

#: Prefix Opacus' ``GradSampleModule`` adds to every ``state_dict`` key.
OPACUS_PREFIX = "_module."


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
    """Remove Opacus' ``_module.`` prefixes so keys match the unwrapped model."""
    stripped: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        name = key
        while name.startswith(OPACUS_PREFIX):
            name = name[len(OPACUS_PREFIX) :]
        stripped[name] = value.detach().clone()
    return stripped


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
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss = _loss(model, images[batch], labels[batch])
    loss.backward()
    optimizer.step()
    return TrainOutcome(
        state_dict=strip_opacus_prefix(model.state_dict()),
        num_examples=len(chosen),
        sample_indices=[int(index) for index in chosen],
        loss=float(loss.detach()),
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
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model.train()
    losses: list[float] = []
    used: dict[int, None] = {}
    for _ in range(epochs):
        order = rng.permutation(indices)
        for start in range(0, len(order), mini_batch_size):
            chunk = order[start : start + mini_batch_size]
            batch = torch.as_tensor(chunk, dtype=torch.long)
            optimizer.zero_grad(set_to_none=True)
            loss = _loss(model, images[batch], labels[batch])
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            used.update(dict.fromkeys(int(index) for index in chunk))
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
                loss.backward()
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
