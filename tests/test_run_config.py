"""The run config: one source of keys, closest-key errors, from_context, client-side data settings."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg
from torch import nn

from clients.client_app import LOCAL_KEYS, _Settings
from clients.ground_truth import attach_ground_truth, ground_truth_enabled, layer_inputs
from fl_attack.audit.protocol import GROUND_TRUTH_INPUTS, GROUND_TRUTH_KEY
from strategies import HonestButCuriousStrategy, RunConfigError, resolve_audit_config, resolve_run_config
from strategies.cli import main as audit_main
from strategies.factory import build_auditor
from strategies.server_app import build_strategy, full_batch_local_steps


def _context(run_config: dict[str, Any] | None = None, node_config: dict[str, Any] | None = None) -> Context:
    return Context(
        run_id=1, node_id=1, node_config=node_config or {}, state=RecordDict(), run_config=run_config or {}
    )


def test_unknown_key_names_the_closest_one() -> None:
    with pytest.raises(
        RunConfigError, match="unknown run-config key 'attack-time-budgt'; did you mean 'attack-time-budget'"
    ):
        resolve_run_config({"attack-time-budgt": 5.0})
    with pytest.raises(RunConfigError, match="'num-server-round'; did you mean 'num-server-rounds'"):
        resolve_run_config({}, {"num-server-round": 3})


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("attack-time-budget", float("nan"), "finite"),
        ("attack-time-budget", 0.0, "positive"),
        ("attack-time-budget", -1.0, "positive"),
        ("batch-size", 10.5, "must be a int"),
        ("train-mode", "adam", "one of fedsgd, fedavg, dpsgd"),
        ("attack-fraction", 1.5, "at most 1"),
        ("attack-gpu-memory", 1.5, "at most 1"),
        ("attack-gpu-memory", -0.25, "at least 0"),
        ("attack-partitions", "0,x", "comma-separated integers"),
    ],
)
def test_bad_values_are_one_clear_line(key: str, value: Any, message: str) -> None:
    with pytest.raises(RunConfigError, match=message) as raised:
        resolve_run_config({key: value})
    assert key in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(("value", "share"), [(0.0, None), (0.25, 0.25), (1.0, 1.0)])
def test_the_gpu_memory_share_reaches_the_auditors_execution_settings(
    value: float, share: float | None
) -> None:
    config = {"attack-gpu-memory": value, "attack-isolation": "thread", "attack-device": "cpu"}
    auditor = build_auditor(config, store=None)
    try:
        assert auditor.execution.attack_gpu_memory == share  # 0: no cap
    finally:
        auditor.close()


def test_audit_config_of_any_app_ignores_the_users_keys_but_not_audit_typos() -> None:
    config = resolve_audit_config({"lr": 0.01, "num-server-rounds": 3, "attack-time-budget": 7})
    assert config["attack-time-budget"] == 7.0 and "lr" not in config and "num-server-rounds" not in config
    with pytest.raises(RunConfigError, match="did you mean 'attack-fraction'"):
        resolve_audit_config({"attack-fractoin": 0.5})


def test_from_context_reads_the_run_config_and_overrides_win(tmp_path: Path) -> None:
    context = _context(
        {"lr": 0.1, "attack-time-budget": 12.0, "attack-fraction": 0.5, "output-dir": str(tmp_path / "a")}
    )
    strategy = HonestButCuriousStrategy.from_context(
        FedAvg(), context, attack_time_budget=3.0, output_dir=str(tmp_path / "b"), attack_isolation="thread"
    )
    auditor = strategy.auditor
    assert auditor.attack.time_budget == 3.0 and auditor.sampling.attack_fraction == 0.5
    assert auditor.store is not None and auditor.store.directory == tmp_path / "b"
    assert not (tmp_path / "a").exists()
    strategy.close()


def test_local_steps_reach_the_attack_and_are_refused_where_they_cannot_hold(tmp_path: Path) -> None:
    strategy = HonestButCuriousStrategy.from_context(
        FedAvg(),
        _context({"attack-local-steps": 10}),
        output_dir=str(tmp_path / "a"),
        attack_isolation="thread",
    )
    assert getattr(strategy.auditor.attacker, "local_steps", None) == 10
    strategy.close()
    with pytest.raises(RunConfigError, match="secagg-group-size=4 sums several clients' updates"):
        HonestButCuriousStrategy.from_context(
            FedAvg(),
            _context({"attack-local-steps": 10, "secagg-group-size": 4}),
            output_dir=str(tmp_path / "b"),
        )
    with pytest.raises(RunConfigError, match="the attack 'cocktail-party' does not take local steps"):
        HonestButCuriousStrategy.from_context(
            FedAvg(),
            _context({"attack-local-steps": 10}),
            attack_name="cocktail-party",
            output_dir=str(tmp_path),
        )
    with pytest.raises(RunConfigError, match="attack-local-steps"):
        resolve_audit_config({"attack-local-steps": -1})


def test_from_context_rejects_typos_and_wrong_strategies(tmp_path: Path) -> None:
    with pytest.raises(RunConfigError, match="did you mean 'attack-time-budget'"):
        HonestButCuriousStrategy.from_context(FedAvg(), _context(), attack_time_budgt=3.0)
    with pytest.raises(TypeError, match="Message-API strategy"):
        HonestButCuriousStrategy.from_context(object(), _context(), output_dir=str(tmp_path))  # type: ignore[arg-type]


def test_a_server_message_never_sets_the_clients_data_paths() -> None:
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, 1
    try:
        message = Message(
            RecordDict({"config": ConfigRecord({"data-root": "/etc", "dataset": "folder", "batch-size": 4})}),
            dst_node_id=1,
            message_type=MessageType.TRAIN,
        )
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    _check_local_settings(message)


def _check_local_settings(message: Message) -> None:
    settings = _Settings(message, _context({"dataset": "digits", "data-root": ""}), {})
    assert {"dataset", "data-root"} <= LOCAL_KEYS
    assert settings.text("data-root") == "" and settings.text("dataset") == "digits"
    assert settings.integer("batch-size") == 4  # training settings do come from the server


def test_ground_truth_is_sent_only_when_the_client_opts_in() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 2)
    )
    batch = torch.randn(3, 1, 6, 6)
    content = RecordDict()
    assert not attach_ground_truth(
        content, _context(run_config={"audit-ground-truth": True}), inputs=batch, model=model
    )
    assert GROUND_TRUTH_KEY not in content
    assert not ground_truth_enabled(_context(node_config={"audit-ground-truth": "false"}))
    assert attach_ground_truth(
        content, _context(node_config={"audit-ground-truth": "true"}), inputs=batch, model=model
    )
    sent = content[GROUND_TRUTH_KEY][GROUND_TRUTH_INPUTS].numpy()
    expected = layer_inputs(model, batch).numpy()
    assert sent.shape == (3, 32) and np.array_equal(sent, expected)  # the features entering the first Linear
    with torch.no_grad():
        assert np.allclose(expected, model[:3](batch).numpy())


def test_cli_settings_errors_exit_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert audit_main(["-c", "attack-time-budgt=5"]) == 2
    assert "did you mean 'attack-time-budget'" in capsys.readouterr().err
    assert audit_main(["-c", "dataset='cifar10' data-root='/nonexistent/fl-attack'"]) == 1
    error = capsys.readouterr().err.strip()
    assert "fl-attack-data fetch cifar10" in error and len(error.splitlines()) == 1
    assert audit_main(["--fail-above", "2"]) == 2


def test_leakage_gate_fails_a_leaking_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    settings = (
        "num-server-rounds=1 dataset='digits' width=64 batch-size=4 samples-per-client=16 "
        f"attack-time-budget=10.0 attack-isolation='thread' server-evaluation=false output-dir='{tmp_path / 'run'}'"
    )
    assert audit_main(["--num-supernodes", "2", "--fail-above", "0.01", "-c", settings]) == 3
    captured = capsys.readouterr()
    assert "leakage gate failed" in captured.err and "2 exact" in captured.out


@pytest.mark.parametrize(
    ("settings", "steps"),
    [
        ({"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 20, "local-epochs": 10}, 10),
        ({"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 5, "local-epochs": 10}, 1),
        ({"train-mode": "fedsgd", "samples-per-client": 20, "mini-batch-size": 20, "local-epochs": 10}, 1),
        ({"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 20, "local-epochs": 10,
          "secagg-group-size": 2}, 1),
        ({"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 5, "attack-local-steps": 4}, 4),
        ({"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 20, "local-epochs": 10,
          "attack-local-steps": 1}, 1),
    ],
)  # fmt: skip
def test_this_apps_full_batch_fedavg_steps_reach_the_attack(settings: dict[str, Any], steps: int) -> None:
    """The default app configured its clients, so it knows when their steps are full-batch."""
    config = resolve_run_config({}, settings)
    assert full_batch_local_steps(config) == steps


def test_the_default_apps_strategy_gives_its_full_batch_steps_to_the_attack(tmp_path: Path) -> None:
    settings = {"train-mode": "fedavg", "samples-per-client": 20, "mini-batch-size": 20, "local-epochs": 10}
    config = resolve_run_config(
        {}, {**settings, "output-dir": str(tmp_path / "run"), "attack-isolation": "thread"}
    )
    strategy = build_strategy(config, scorer=None)
    assert isinstance(strategy, HonestButCuriousStrategy)
    assert getattr(strategy.auditor.attacker, "local_steps", None) == 10
    strategy.close()


def test_an_attack_config_file_sets_the_audit_keys(tmp_path: Path) -> None:
    """One key in the app's pyproject, every audit setting in a file; a typo there names the file."""
    settings = tmp_path / "audit.toml"
    settings.write_text('attack-time-budget = 60.0\nattack-fallback = ""\n', encoding="utf-8")
    run_config = {"attack-config": str(settings), "attack-time-budget": 30.0, "lr": 0.1}
    resolved = resolve_audit_config(run_config)
    assert resolved["attack-time-budget"] == 60.0 and resolved["attack-fallback"] == ""
    assert resolve_audit_config(run_config, {"attack-time-budget": 5.0})["attack-time-budget"] == 5.0
    assert resolve_audit_config({"attack-config": ""})["attack-time-budget"] == 30.0
    settings.write_text("attack-time-budgt = 60.0\n", encoding="utf-8")
    with pytest.raises(
        RunConfigError,
        match=rf"in attack-config '{settings}': unknown run-config key 'attack-time-budgt'; "
        "did you mean 'attack-time-budget'",
    ):
        resolve_audit_config(run_config)
    with pytest.raises(RunConfigError, match="attack-config '.*missing.toml' cannot be read"):
        resolve_audit_config({"attack-config": str(tmp_path / "missing.toml")})
