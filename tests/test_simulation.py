"""End-to-end: an in-process Flower simulation whose server recovers the clients' images.

Also checks the client side on its own (partitioning, the three training modes) and that
``pyproject.toml`` and the code agree on the run-config defaults.
"""

from __future__ import annotations

import json
import stat
from pathlib import Path

import numpy as np
import pytest
import tomllib
import torch

from clients.data import client_data
from clients.partition import iid_partition, label_skew_partition, partition_indices
from fl_attack.results.store import load_table
from fl_attack.simulate.training import train_dpsgd, train_fedavg, train_fedsgd
from fl_attack.simulate.victims import build_victim
from strategies.run_config import DEFAULT_RUN_CONFIG, resolve_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_pyproject_defaults_match_the_code() -> None:
    with open(ROOT / "pyproject.toml", "rb") as handle:
        flwr = tomllib.load(handle)["tool"]["flwr"]
    assert flwr["app"]["components"] == {
        "serverapp": "strategies.server_app:app",
        "clientapp": "clients.client_app:simulation_app",
    }
    config = flwr["app"]["config"]
    assert config == DEFAULT_RUN_CONFIG
    assert all(type(config[key]) is type(value) for key, value in DEFAULT_RUN_CONFIG.items())


def test_run_config_is_typed_and_validated() -> None:
    config = resolve_run_config({"width": 100.0, "poisson-sampling": "false"}, {"batch-size": 5})
    assert config["width"] == 100 and isinstance(config["width"], int)
    assert config["poisson-sampling"] is False and config["batch-size"] == 5
    with pytest.raises(ValueError, match="train-mode"):
        resolve_run_config({"train-mode": "sgd"})
    with pytest.raises(ValueError, match="attack-partitions"):
        resolve_run_config({"attack-partitions": "1,x"})
    with pytest.raises(ValueError, match="width"):
        resolve_run_config({"width": "wide"})


def test_partitions_cover_the_data_without_overlap() -> None:
    labels = np.repeat(np.arange(10), 30)
    shares = [iid_partition(len(labels), num_partitions=4, partition_id=p, seed=1) for p in range(4)]
    assert sorted(np.concatenate(shares).tolist()) == list(range(len(labels)))

    skewed = [
        label_skew_partition(labels, num_partitions=5, partition_id=p, labels_per_partition=2, seed=1)
        for p in range(5)
    ]
    assert sorted(np.concatenate(skewed).tolist()) == list(range(len(labels)))
    assert all(len(np.unique(labels[share])) == 2 for share in skewed)

    limited = partition_indices(
        labels, scheme="label-skew", num_partitions=5, partition_id=0, limit=7, seed=1
    )
    assert len(limited) == 7 and set(limited) <= set(skewed[0])
    with pytest.raises(ValueError, match="partitioning"):
        partition_indices(labels, scheme="dirichlet", num_partitions=2, partition_id=0)


def _digits_client() -> tuple[torch.nn.Module, object]:
    data = client_data(
        dataset="digits",
        data_root="",
        dataset_limit=0,
        partitioning="iid",
        num_partitions=3,
        partition_id=1,
        samples_per_client=20,
        labels_per_client=2,
        seed=0,
    )
    model = build_victim(input_dim=data.input_dim, width=16, num_classes=data.num_classes, seed=0)
    return model, data


def test_training_modes_report_what_they_trained_on() -> None:
    torch.set_num_threads(1)
    model, data = _digits_client()
    initial = {key: value.clone() for key, value in model.state_dict().items()}

    fedsgd = train_fedsgd(
        model, data.images, data.labels, data.indices, batch_size=5, lr=0.1, rng=np.random.default_rng(0)
    )
    assert fedsgd.num_examples == 5 and fedsgd.steps == 1
    assert len(set(fedsgd.sample_indices)) == 5 and set(fedsgd.sample_indices) <= set(data.indices.tolist())
    assert not torch.equal(fedsgd.state_dict["1.weight"], initial["1.weight"])

    model.load_state_dict(initial)
    fedavg = train_fedavg(
        model,
        data.images,
        data.labels,
        data.indices,
        epochs=2,
        mini_batch_size=8,
        lr=0.1,
        rng=np.random.default_rng(0),
    )
    assert fedavg.num_examples == 20 and fedavg.steps == 2 * 3
    assert sorted(fedavg.sample_indices) == sorted(data.indices.tolist())

    for poisson in (True, False):
        model, data = _digits_client()
        dpsgd = train_dpsgd(
            model,
            data.images,
            data.labels,
            data.indices,
            epochs=1,
            mini_batch_size=5,
            lr=0.1,
            noise_multiplier=1.0,
            max_grad_norm=1.0,
            poisson_sampling=poisson,
            seed=3,
        )
        assert list(dpsgd.state_dict) == list(initial)  # Opacus' "_module." prefix stripped
        assert set(dpsgd.sample_indices) <= set(data.indices.tolist())
        assert dpsgd.steps == 4
        if not poisson:
            assert sorted(dpsgd.sample_indices) == sorted(data.indices.tolist())


def test_simulation_recovers_fedsgd_batches_exactly(tmp_path: Path) -> None:
    from flwr.simulation import run_simulation

    from clients.client_app import create_client_app
    from strategies.server_app import create_server_app

    output = tmp_path / "run"
    settings = {
        "num-server-rounds": 2,
        "min-nodes": 3,
        "dataset": "digits",
        "width": 100,
        "batch-size": 5,
        "samples-per-client": 40,
        "train-mode": "fedsgd",
        "attack-time-budget": 40.0,
        "attack-timeout": 120.0,
        "output-dir": str(output),
    }
    run_simulation(
        server_app=create_server_app(settings),
        client_app=create_client_app(resolve_run_config({}, settings), ground_truth=True),
        num_supernodes=3,
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": 2, "num_gpus": 0},
        },
    )

    rows = load_table(output / "attacks.csv")
    assert sorted((row["round"], row["client"]) for row in rows) == [
        (str(r), f"partition-{p}") for r in (1, 2) for p in range(3)
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["complete"] == "True"
        assert row["verdict"] == "exact" and row["input_space"] == "inputs", row
        assert int(row["num_references"]) == 5
        assert float(row["min_psnr"]) > 90.0, row
        directory = output / row["directory"]
        metrics = json.loads((directory / "metrics.json").read_text())
        assert metrics["details"]["train_mode"] == "fedsgd"
        assert len(metrics["psnr"]) == 5 and min(metrics["psnr"]) > 90.0
        inputs = np.load(directory / "reconstruction.npy", allow_pickle=False)
        assert inputs.shape == (5, 64)
        assert (directory / "reconstruction.png").stat().st_size > 0
    assert stat.S_IMODE(output.stat().st_mode) == 0o700
    stored_config = json.loads((output / "run_config.json").read_text())
    assert stored_config["width"] == 100 and stored_config["dataset"] == "digits"
    history = json.loads((output / "history.json").read_text())
    assert [entry["round"] for entry in history["rounds"]] == [0, 1, 2]
    assert history["rounds"][0]["train"] is None  # round 0: the initial model, tested only
    for entry in history["rounds"]:
        assert entry["test"]["test-examples"] == 359  # the digits test split
        assert 0.0 <= entry["test"]["test-acc"] <= 1.0
    assert history["rounds"][2]["train"]["train-loss"] > 0.0
    assert history["final_test"] == history["rounds"][2]["test"]
