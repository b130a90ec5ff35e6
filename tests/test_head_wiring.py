"""The auditor hands the global output-layer weight to attacks on one-hidden-layer models."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from fl_attack import LayerUpdate, Reconstruction, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.attacks.cocktail_party import CocktailPartyAttack
from fl_attack.audit import AttackSettings, Auditor, workers
from fl_attack.audit.layer import global_parameters, select_layer
from fl_attack.audit.observations import ClientIdentity, ClientUpdate
from fl_attack.audit.workers import run_attack
from fl_attack.data.images import load_dataset
from fl_attack.evaluation.metrics import evaluate_reconstruction
from fl_attack.pipeline.budget.budget import NEXT_LAYER_SHARE, Budget
from fl_attack.pipeline.local_training.known import KnownTraining
from fl_attack.simulate.victims import build_victim
from fl_attack.types import OPTIONAL_PARTS

WIDTH, BATCH, LR = 200, 8, 0.1


class HeadSpy(SpearPlusPlus):
    """SPEAR++ that remembers the ``head_weight`` and ``next_weight_update`` of each update it received."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.heads: list[np.ndarray | None] = []
        self.following: list[np.ndarray | None] = []

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        self.heads.append(None if update.head_weight is None else np.array(update.head_weight))
        following = update.next_weight_update
        self.following.append(None if following is None else np.array(following))
        return super().attack(update, **options)


class PartsSpy(LayerAttackBase):
    """Remembers every update and time budget it is given; uses the optional parts a subclass declares."""

    def __init__(self) -> None:
        self.received: list[tuple[LayerUpdate[Any], Budget | None]] = []

    def attack(
        self, update: LayerUpdate[Any], /, *, batch_size: int | None = None, budget: Budget | None = None
    ) -> Reconstruction:
        self.received.append((update, budget))
        rows = torch.zeros(2, np.shape(update.weight_update)[1], dtype=torch.float64)
        return Reconstruction(
            inputs=rows,
            batch_size=2,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(2, dtype=torch.float64),
            seconds=0.0,
        )


def _spy(uses: frozenset[str]) -> PartsSpy:
    return type("Spy", (PartsSpy,), {"uses": uses})()


def _full_update(
    *, after_layers: bool = False, next_weight_update: np.ndarray | None = None
) -> LayerUpdate[np.ndarray]:
    """A two-sample update of a (40, 12) layer with every optional part."""
    rng = np.random.default_rng(0)
    weight, bias = rng.standard_normal((40, 12)), rng.standard_normal(40)
    inputs = rng.standard_normal((2, 12))
    output_grad = ((inputs @ weight.T + bias) > 0) * rng.standard_normal((2, 40))
    return LayerUpdate(
        weight_update=output_grad.T @ inputs,
        bias_update=output_grad.sum(axis=0),
        weight=weight,
        bias=bias,
        head_weight=rng.standard_normal((10, 40)),
        next_weight_update=rng.standard_normal((6, 40)) if next_weight_update is None else next_weight_update,
        after_layers=after_layers,
        local_steps=3,
        noise_level=0.1,
        local_training=KnownTraining(mini_batch_size=1, momentum=0.9),
    )


def _arrays(model: nn.Module) -> dict[str, np.ndarray]:
    return {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four threes and four eights of the bundled digits: same-class pairs defeat the plain search."""
    data = load_dataset("digits")
    chosen = torch.cat([torch.nonzero(data.labels == label).flatten()[: BATCH // 2] for label in (3, 8)])
    return data.images[chosen].reshape(BATCH, -1), data.labels[chosen]


def _audit(
    depth: int, attacker: Any
) -> tuple[Auditor, dict[str, np.ndarray], torch.Tensor, dict[str, np.ndarray]]:
    """One FedSGD round of one client of a ``depth``-linear-layer victim, audited in this thread;
    the auditor, the global arrays, the client's inputs and the arrays it sent."""
    inputs, labels = _batch()
    model = build_victim("spear++", input_dim=inputs.shape[1], width=WIDTH, depth=depth, seed=0)
    global_arrays = _arrays(model)
    client = copy.deepcopy(model)
    gradients = torch.autograd.grad(
        nn.functional.cross_entropy(client(inputs), labels), list(client.parameters())
    )
    with torch.no_grad():
        for parameter, gradient in zip(client.parameters(), gradients, strict=True):
            parameter.sub_(LR * gradient)
    auditor = Auditor(attacker, attack=AttackSettings(batch_size=BATCH, time_budget=30.0))
    auditor.start_round(1, global_arrays)
    sent = _arrays(client)
    update = ClientUpdate(identity=ClientIdentity(node_id=7, partition_id=0), arrays=sent)
    auditor.audit_round(1, [update])
    auditor.close()
    return auditor, global_arrays, inputs, sent


def test_a_one_hidden_layer_model_gets_its_global_head_and_is_recovered_exactly() -> None:
    spy = HeadSpy(seed=0, progress=False)
    auditor, global_arrays, inputs, _ = _audit(2, spy)
    assert auditor.layer is not None and auditor.layer.head == "3.weight"
    (head,) = spy.heads
    assert head is not None and np.array_equal(head, global_arrays["3.weight"].astype(np.float64))
    (record,) = auditor.records
    assert record.status == "ok" and record.verdict == "exact", record.verdict_reason
    assert record.attack["complete"] is True and record.attack["head_searches"] >= 1
    assert record.inputs is not None
    quality = evaluate_reconstruction(torch.as_tensor(record.inputs), inputs.double())
    assert quality.exact_fraction == 1.0 and float(quality.psnr.min()) > 90.0


def test_a_deeper_model_passes_no_head() -> None:
    spy = HeadSpy(seed=0, progress=False, time_budget=5.0)
    auditor, _, _, _ = _audit(4, spy)
    assert auditor.layer is not None and auditor.layer.head is None
    assert spy.heads == [None]
    (record,) = auditor.records
    assert "head_searches" not in record.attack


def test_a_deeper_model_passes_the_clients_change_of_the_next_layer() -> None:
    spy = HeadSpy(seed=0, progress=False, time_budget=5.0)
    auditor, global_arrays, _, sent = _audit(4, spy)
    (following,) = spy.following
    # what the client sent for the next layer, differenced in float64 by the server
    expected = sent["3.weight"].astype(np.float64) - global_arrays["3.weight"].astype(np.float64)
    assert following is not None and np.array_equal(following, expected)
    (record,) = auditor.records
    assert record.status == "ok" and record.attack["next_layer"] in ("not needed", "on"), record.attack


@pytest.mark.parametrize(
    "uses",
    [
        frozenset(),
        frozenset({"head_weight"}),
        frozenset({"next_weight_update", "local_steps"}),
        OPTIONAL_PARTS,
    ],
    ids=["none", "head", "next-and-steps", "all"],
)
def test_the_declared_uses_decide_which_optional_parts_an_attack_receives(uses: frozenset[str]) -> None:
    update = _full_update()
    spy = _spy(uses)
    result = run_attack(spy, update, batch_size=2, time_budget=10.0)
    assert result.status == "ok", result.error
    ((received, budget),) = spy.received
    # no next-layer route on a first layer: the attack gets the whole budget
    assert budget is not None and budget.seconds == 10.0
    for name in ("weight_update", "bias_update", "weight", "bias"):
        assert getattr(received, name) is getattr(update, name)
    for part in OPTIONAL_PARTS:
        expected = getattr(update, part) if part in uses else None
        assert getattr(received, part) is expected, part


def test_a_zero_next_layer_update_is_never_offered() -> None:
    # a frozen next layer holds no activations: even an attack that uses it gets none
    spy = _spy(OPTIONAL_PARTS)
    update = _full_update(next_weight_update=np.zeros((6, 40)))
    assert run_attack(spy, update, batch_size=2, time_budget=10.0).status == "ok"
    ((received, _),) = spy.received
    assert received.next_weight_update is None and received.head_weight is update.head_weight


def test_the_next_layer_route_follows_an_attack_that_does_not_use_the_next_layer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the route gets the whole update and the rest of the budget whatever the attack itself reads
    routed: list[tuple[LayerUpdate[Any], Budget | None]] = []

    def route(reconstruction: Any, update: LayerUpdate[Any], *, budget: Budget | None, **_: Any) -> Any:
        routed.append((update, budget))
        return reconstruction

    monkeypatch.setattr(workers, "with_next_layer", route)
    spy = _spy(frozenset())
    update = _full_update(after_layers=True)
    assert run_attack(spy, update, batch_size=2, time_budget=10.0).status == "ok"
    ((received, budget),) = spy.received
    assert received.next_weight_update is None
    assert budget is not None and budget.seconds == (1.0 - NEXT_LAYER_SHARE) * 10.0 == 5.0
    ((routed_update, route_budget),) = routed
    assert routed_update is update
    assert (
        route_budget is not None and route_budget.seconds == 10.0 and route_budget.started == budget.started
    )


def test_an_attack_without_the_optional_parts_runs_on_a_full_update_and_refuses_them_in_invert() -> None:
    # the Cocktail Party attack uses no optional part: the audit leaves them out, invert() refuses them
    assert CocktailPartyAttack.uses == frozenset()
    assert {"head_weight", "next_weight_update"} <= SpearPlusPlus.uses
    update = _full_update()
    result = run_attack(CocktailPartyAttack(), update, batch_size=2, time_budget=10.0)
    assert result.status == "ok", result.error
    arrays = {"weight": update.weight, "bias": update.bias, "batch_size": 2}
    with pytest.raises(
        TypeError, match=r"CocktailPartyAttack.invert\(\) does not take head_weight, next_weight_grad"
    ):
        CocktailPartyAttack().invert(
            update.weight_update,
            update.bias_update,
            head_weight=update.head_weight,
            next_weight_grad=update.next_weight_update,
            **arrays,
        )
    plain = CocktailPartyAttack().invert(update.weight_update, update.bias_update, **arrays)
    assert torch.equal(plain.inputs, result.reconstruction.inputs)


@pytest.mark.parametrize(
    ("arrays", "head"),
    [
        # fc1 after convolutions, then the output layer: the head follows fc1
        ({"0.weight": (4, 1, 3, 3), "0.bias": (4,), "fc1.weight": (32, 36), "fc1.bias": (32,),
          "fc2.weight": (10, 32), "fc2.bias": (10,)}, "fc2.weight"),
        # a bias-free output layer
        ({"1.weight": (32, 12), "1.bias": (32,), "3.weight": (10, 32)}, "3.weight"),
        # a normalisation layer between: the ReLU does not feed the head directly
        ({"1.weight": (32, 12), "1.bias": (32,), "2.weight": (32,), "2.bias": (32,),
          "4.weight": (10, 32), "4.bias": (10,)}, None),
        # one logit (binary classifier): two-valued columns like two classes
        ({"1.weight": (32, 12), "1.bias": (32,), "3.weight": (1, 32), "3.bias": (1,)}, "3.weight"),
        # another hidden layer follows
        ({"1.weight": (32, 12), "1.bias": (32,), "3.weight": (32, 32), "3.bias": (32,),
          "5.weight": (10, 32), "5.bias": (10,)}, None),
        # the attacked layer is the model's last
        ({"1.weight": (10, 12), "1.bias": (10,)}, None),
    ],
)  # fmt: skip
def test_the_head_is_the_next_and_last_weight(arrays: dict[str, tuple[int, ...]], head: str | None) -> None:
    named = {key: np.ones(shape, dtype=np.float32) for key, shape in arrays.items()}
    weight_key = "fc1.weight" if "fc1.weight" in named else None
    layer = select_layer(named, weight_key=weight_key)
    assert layer.head == head
    _, _, head_weight = global_parameters(named, layer)
    assert (head_weight is None) == (head is None)
    if head is not None:
        assert head_weight is not None and head_weight.dtype == np.float64
        assert head_weight.shape == arrays[head]


def test_a_secure_aggregation_sum_keeps_the_head() -> None:
    zeros = np.zeros((3, 2))
    one = LayerUpdate(zeros, np.zeros(3), zeros, np.zeros(3), head_weight=np.ones((4, 3)))
    total = one + one
    assert total.head_weight is not None and np.array_equal(total.head_weight, np.ones((4, 3)))
