"""Several attacks on one GPU: a stream per attack, a memory cap per process, Ray's shares.

No GPU is needed: CUDA is mocked (``torch.cuda.is_available`` and the stream / memory calls) where
the CUDA path is checked, and the real attack runs on the CPU where results are compared.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from fl_attack import LayerUpdate, SpearPlusPlus
from fl_attack.attacks import LayerAttackBase
from fl_attack.audit import (
    AttackSettings,
    Auditor,
    ClientIdentity,
    ClientUpdate,
    ExecutionSettings,
    device_share,
    ray_runner,
)
from fl_attack.audit.device_share import cap_gpu_memory, check_gpu_memory_share, cuda_device_of, own_stream
from fl_attack.audit.ray_runner import RayAttackRunner
from fl_attack.audit.workers import ThreadAttackRunner, _invert, make_runner
from fl_attack.reconstruction import Reconstruction
from fl_attack.simulate.victims import build_victim
from fl_attack.vocabulary import STATUS_OK, STATUS_OUT_OF_MEMORY

SHARE_MESSAGE = r"must be a fraction of the GPU's memory in \(0, 1\] or None"


class DeviceAttacker(LayerAttackBase):
    """Says it runs on ``device``; returns two zero rows and notes the stream it ran on."""

    def __init__(self, device: str = "cuda", *, error: BaseException | None = None) -> None:
        self.device = device
        self.error = error
        self.streams: list[Any] = []

    def attack(self, update: LayerUpdate[Any], /, **options: Any) -> Reconstruction:
        if torch.cuda.is_available():  # mocked: the test's fake CUDA
            self.streams.append(torch.cuda.current_stream(None))
        if self.error is not None:
            raise self.error
        return Reconstruction(
            inputs=torch.zeros((2, update.weight_update.shape[1]), dtype=torch.float64),
            batch_size=2,
            sparsity_matching=1.0,
            complete=True,
            confidence=torch.ones(2, dtype=torch.float64),
            seconds=0.0,
        )


def _tiny_update() -> LayerUpdate[np.ndarray]:
    rng = np.random.default_rng(0)
    return LayerUpdate(
        rng.standard_normal((5, 3)), rng.standard_normal(5), weight=np.zeros((5, 3)), bias=np.zeros(5)
    )


class FakeStream:
    """A CUDA stream's bookkeeping: what it waited for and how often it was synchronized."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.waited_for: list[Any] = []
        self.synchronized = 0

    def wait_stream(self, other: Any) -> None:
        self.waited_for.append(other)

    def synchronize(self) -> None:
        self.synchronized += 1


class FakeCuda:
    """CUDA as the code under test sees it: available, with per-thread current streams and a
    per-process memory fraction, all recorded."""

    def __init__(self) -> None:
        self.default = FakeStream("default")
        self.made: list[FakeStream] = []
        self.fractions: list[tuple[float, Any]] = []
        self._current = threading.local()

    def stream_class(self, device: Any = None) -> FakeStream:
        stream = FakeStream(device)
        self.made.append(stream)
        return stream

    def current_stream(self, device: Any = None) -> Any:
        return getattr(self._current, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        before = self.current_stream()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = before

    def set_per_process_memory_fraction(self, fraction: float, device: Any = None) -> None:
        # what torch accepts: a float, and an index or None (the current device)
        if not isinstance(fraction, float) or not (device is None or isinstance(device, int)):
            raise TypeError(f"torch refuses set_per_process_memory_fraction({fraction!r}, {device!r})")
        self.fractions.append((fraction, device))


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "Stream", cuda.stream_class)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", cuda.stream)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", cuda.set_per_process_memory_fraction)
    monkeypatch.setattr(device_share, "_STREAMS", device_share._StreamPool())  # no stream of another test
    return cuda


@pytest.mark.parametrize("share", [0, 0.0, -0.25, 1.5, float("nan"), float("inf"), True, "0.5"])
def test_a_memory_share_outside_zero_to_one_is_refused_naming_it(share: Any) -> None:
    with pytest.raises(ValueError, match=rf"attack_gpu_memory {SHARE_MESSAGE}, got {share!r}"):
        check_gpu_memory_share(share)
    with pytest.raises(ValueError, match=rf"attack_gpu_memory {SHARE_MESSAGE}"):
        ExecutionSettings(attack_gpu_memory=share)
    with pytest.raises(ValueError, match=SHARE_MESSAGE):
        ThreadAttackRunner(DeviceAttacker("cpu"), gpu_memory=share)
    with pytest.raises(ValueError, match=SHARE_MESSAGE):
        RayAttackRunner(DeviceAttacker("cpu"), num_gpus=0.5, gpu_memory=share)


@pytest.mark.parametrize("share", [None, 0.01, 0.5, 1, 1.0])
def test_a_memory_share_in_range_or_none_is_accepted(share: float | None) -> None:
    check_gpu_memory_share(share)
    assert ExecutionSettings(attack_gpu_memory=share).attack_gpu_memory == share


def test_the_cap_sets_the_fraction_on_the_attackers_cuda_device(fake_cuda: FakeCuda) -> None:
    assert cap_gpu_memory(0.3, DeviceAttacker("cuda:1")) is True
    assert cap_gpu_memory(0.25, DeviceAttacker("auto")) is True
    assert cap_gpu_memory(1.0, DeviceAttacker("cuda")) is True
    assert fake_cuda.fractions == [(0.3, 1), (0.25, None), (1.0, None)]  # None: the current device


def test_the_cap_does_nothing_without_a_share_or_on_the_cpu(fake_cuda: FakeCuda) -> None:
    assert cap_gpu_memory(None, DeviceAttacker("cuda")) is False
    assert cap_gpu_memory(0.5, DeviceAttacker("cpu")) is False
    assert cap_gpu_memory(0.5, object()) is False  # an attacker without a device runs on the CPU
    assert fake_cuda.fractions == []


def test_without_cuda_nothing_touches_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> None:
        raise AssertionError("a CUDA call on a machine without CUDA")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", refuse)
    monkeypatch.setattr(torch.cuda, "Stream", refuse)
    for device in ("auto", "cpu", "cuda"):
        attacker = DeviceAttacker(device)
        assert cuda_device_of(attacker) is None
        assert cap_gpu_memory(0.5, attacker) is False
        with own_stream(attacker) as stream:
            assert stream is None
    # the attack itself still runs (on the CPU: its stream is the default one, untouched)
    result = ThreadAttackRunner(DeviceAttacker("cpu"), gpu_memory=0.5).run(_tiny_update(), timeout=30.0)
    assert result.status == STATUS_OK


def test_concurrent_cuda_attacks_each_run_on_a_stream_of_their_own(fake_cuda: FakeCuda) -> None:
    attacker = DeviceAttacker("cuda")
    inside = threading.Barrier(3, timeout=30.0)
    seen: dict[int, Any] = {}

    def attack(index: int) -> None:
        with own_stream(attacker) as stream:
            seen[index] = (stream, torch.cuda.current_stream(None))
            inside.wait()  # all three are inside at once

    threads = [threading.Thread(target=attack, args=(index,)) for index in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30.0)
    streams = [seen[index][0] for index in range(3)]
    assert [seen[index][1] for index in range(3)] == streams  # each thread's current stream is its own
    assert len({id(stream) for stream in streams}) == 3 and fake_cuda.default not in streams
    for stream in streams:
        assert stream.waited_for == [fake_cuda.default]  # after what the thread had queued before
        assert stream.synchronized == 1  # before the results are read
    assert fake_cuda.current_stream() is fake_cuda.default  # this thread's stream is unchanged
    with own_stream(attacker) as again:
        assert fake_cuda.current_stream() is again  # the block runs on the stream it was given
    assert again in streams and len(fake_cuda.made) == 3  # a free stream is reused, not made anew


def test_a_failing_cuda_attack_synchronizes_its_stream_and_gives_it_back(fake_cuda: FakeCuda) -> None:
    attacker = DeviceAttacker("cuda")
    with pytest.raises(torch.cuda.OutOfMemoryError), own_stream(attacker) as stream:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert stream is not None and stream.synchronized == 1
    with own_stream(attacker) as again:
        assert again is stream


def test_every_attack_call_runs_capped_and_on_its_own_stream(fake_cuda: FakeCuda) -> None:
    attacker = DeviceAttacker("cuda:0")
    _invert(attacker, _tiny_update(), None, 5.0, 0.4)
    assert fake_cuda.fractions == [(0.4, 0)]
    (stream,) = attacker.streams
    assert stream in fake_cuda.made and stream.synchronized == 1
    result = make_runner(attacker, "thread", gpu_memory=0.2).run(_tiny_update(), timeout=30.0)
    assert result.status == STATUS_OK and fake_cuda.fractions[-1] == (0.2, 0)
    assert attacker.streams[-1] in fake_cuda.made


def test_an_attack_past_its_memory_cap_is_recorded_as_out_of_memory(fake_cuda: FakeCuda) -> None:
    error = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    runner = ThreadAttackRunner(DeviceAttacker("cuda", error=error), gpu_memory=0.1)
    result = runner.run(_tiny_update(), timeout=30.0)
    assert result.status == STATUS_OUT_OF_MEMORY and "OutOfMemoryError" in (result.error or "")
    assert fake_cuda.fractions == [(0.1, None)]


@pytest.mark.parametrize(
    ("num_gpus", "gpu_memory", "expected"),
    [
        (0.25, None, 0.25),
        (0.5, 0.1, 0.1),
        (1.0, None, None),
        (2.0, None, None),
        (0.0, None, None),
        (1.0, 0.3, 0.3),
    ],
)
def test_a_fractional_ray_gpu_also_caps_memory(
    num_gpus: float, gpu_memory: float | None, expected: Any
) -> None:
    runner = RayAttackRunner(DeviceAttacker("cpu"), num_gpus=num_gpus, gpu_memory=gpu_memory)
    assert runner.gpu_memory == expected
    settings = ExecutionSettings(backend="ray", attack_gpus=num_gpus, attack_gpu_memory=gpu_memory)
    made = settings.make_runner(DeviceAttacker("cpu"))
    assert isinstance(made, RayAttackRunner) and made.gpu_memory == expected


def _fake_ray(calls: dict[str, Any]) -> types.ModuleType:
    """A Ray that runs each task at once in this thread and notes its options and arguments."""
    ray = types.ModuleType("ray")

    class Task:
        def __init__(self, function: Any) -> None:
            self.function = function

        def options(self, **options: Any) -> Task:
            calls["options"] = options
            return self

        def remote(self, *args: Any) -> Any:
            calls["args"] = args
            return self.function(*args)

    ray.is_initialized = lambda: True  # type: ignore[attr-defined]
    ray.remote = Task  # type: ignore[attr-defined]
    ray.wait = lambda references, timeout=None: (list(references), [])  # type: ignore[attr-defined]
    ray.get = lambda reference: reference  # type: ignore[attr-defined]
    return ray


def test_a_ray_task_on_a_gpu_fraction_is_held_to_that_share_of_memory(
    fake_cuda: FakeCuda, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: dict[str, Any] = {}
    monkeypatch.setitem(sys.modules, "ray", _fake_ray(calls))
    monkeypatch.setattr(ray_runner, "make_board", lambda: None)
    attacker = DeviceAttacker("cuda")
    runner = RayAttackRunner(attacker, num_cpus=1.0, num_gpus=0.25)
    result = runner.run(_tiny_update(), time_budget=5.0, timeout=30.0)
    assert result.status == STATUS_OK, result.error
    assert calls["options"] == {"num_cpus": 1.0, "num_gpus": 0.25, "max_retries": 0}
    assert calls["args"][-1] == 0.25  # the task is told its share...
    assert fake_cuda.fractions == [(0.25, None)]  # ...and sets it before it attacks
    assert attacker.streams[0] in fake_cuda.made


def _client_step(seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    """Global arrays, the arrays a FedSGD client (lr 0.1, float32) sends after a step on 4 Gaussian
    samples drawn from ``seed``, and those samples; the first layer is 30 -> 50."""
    model = build_victim("spear++", input_dim=30, width=50, depth=2, seed=0)
    inputs = torch.randn(4, 30, generator=torch.Generator().manual_seed(seed))
    before = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    loss = torch.nn.functional.cross_entropy(model(inputs), torch.arange(4) % 10)
    gradients = torch.autograd.grad(loss, list(model.parameters()))
    with torch.no_grad():
        for parameter, gradient in zip(model.parameters(), gradients, strict=True):
            parameter.sub_(0.1 * gradient)
    after = {key: value.detach().numpy().copy() for key, value in model.state_dict().items()}
    return before, after, inputs.double().numpy()


def _audit(workers: int, clients: list[tuple[dict[str, np.ndarray], np.ndarray]], global_arrays: Any) -> Any:
    auditor = Auditor(
        SpearPlusPlus(seed=0, device="cpu", progress=False),
        attack=AttackSettings(batch_size=4, time_budget=60.0, timeout=120.0, fallback="none"),
        execution=ExecutionSettings(isolation="thread", workers=workers, attack_gpu_memory=0.5),
    )
    auditor.start_round(1, global_arrays)
    updates = [
        ClientUpdate(identity=ClientIdentity(node_id=10 + k, partition_id=k), arrays=sent)
        for k, (sent, _) in enumerate(clients)
    ]
    auditor.audit_round(1, updates)
    auditor.close()
    return {record.client: record for record in auditor.records}


def test_three_attacks_at_once_give_the_reconstructions_of_one_at_a_time() -> None:
    steps = [_client_step(seed) for seed in range(4)]
    global_arrays = steps[0][0]
    clients = [(sent, inputs) for _, sent, inputs in steps]
    alone = _audit(0, clients, global_arrays)
    together = _audit(3, clients, global_arrays)
    assert sorted(alone) == sorted(together) == [f"partition-{k}" for k in range(4)]
    for k, (_, truth) in enumerate(clients):
        first, second = alone[f"partition-{k}"], together[f"partition-{k}"]
        assert first.status == second.status == STATUS_OK
        assert first.verdict == second.verdict == "exact", (first.verdict_reason, second.verdict_reason)
        assert np.array_equal(first.inputs, second.inputs)
        distances = np.linalg.norm(first.inputs[:, None, :] - truth[None, :, :], axis=2).min(axis=1)
        assert float(distances.max() / np.linalg.norm(truth, axis=1).min()) < 1e-4
