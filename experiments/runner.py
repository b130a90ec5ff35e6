"""The one runner of every table: draw trials, observe, attack, score, write, summarise.

Settings with the same victim and data attack the same trials: trial t draws its batch and
its victim from seed ``seed + t``, and every setting and method of the group attacks what the
server observes of that trial. An attack that raises, or overruns its hard wall-clock limit
(``2 x budget + hard_limit_slack`` seconds; the attack checks its own budget only between
search rounds), is a failed batch with its error recorded: a run never crashes on one batch.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import threading
import time
import types
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

from experiments.config import METHODS, Cell, Setting
from experiments.observe import FACTS, Data, Observation, Trial, draw_trial, observe
from experiments.output import ResultsWriter, dataset_missing
from experiments.scoring import Outcome, client_recovery, metric_fields, score, summarize
from experiments.tables import published
from fl_attack import InvertingGradients, get_attack
from fl_attack.attacks.spear import GradientInversionAttack
from fl_attack.data.images import ImageData, load_dataset
from fl_attack.data.tabular import load_adult
from fl_attack.reconstruction import Reconstruction

Datasets = Mapping[tuple[str, str | None], Data]
"""Loaded datasets by (name, root)."""

_ERROR_CHARS = 300
_WARM_UP = Cell(4, 50)


class AttackTimeout(TimeoutError):
    """Raised inside an attack that overran its hard wall-clock limit."""


class DatasetUnavailable(RuntimeError):
    """A dataset a table needs is not on this machine; the message says how to get it."""


@contextmanager
def hard_time_limit(seconds: float | None) -> Iterator[None]:
    """Interrupt the enclosed code with :class:`AttackTimeout` after ``seconds`` (a ``SIGALRM``).

    A no-op when ``seconds`` is None or outside the main thread.
    """
    if seconds is None or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(signum: int, frame: types.FrameType | None) -> None:
        raise AttackTimeout(f"hard time limit of {seconds:.0f} s exceeded")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, float(seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0.0)
        signal.signal(signal.SIGALRM, previous)


def budget_of(method: str, options: Mapping[str, Any]) -> float | None:
    """The time budget of ``method``: SPEAR and Inverting Gradients may have their own."""
    if METHODS[method].attack == "inverting-gradients":
        return options.get("ig_time_budget")
    if method == "spear" and options.get("spear_time_budget") is not None:
        return float(options["spear_time_budget"])
    return float(options["time_budget"])


def invert(
    method: str, observation: Observation, *, trial: Trial, data: Data, options: Mapping[str, Any]
) -> Reconstruction:
    """Run one method on one observation within its budget and hard limit (raises what the attack raises)."""
    spec, update, budget = METHODS[method], observation.update, budget_of(method, options)
    known = int(trial.inputs.shape[0]) if options["known_batch_size"] else None  # as a FedAvg server
    steps = observation.local_steps if options["known_local_steps"] else 1
    with hard_time_limit(None if budget is None else 2 * budget + float(options["hard_limit_slack"])):
        if spec.attack != "inverting-gradients":
            attack = get_attack(
                spec.attack, seed=trial.seed, time_budget=budget, progress=False, **spec.options
            )
            gradients = (update.weight_update, update.bias_update)
            weight, bias = update.weight, update.bias
            if isinstance(attack, GradientInversionAttack):  # SPEAR, SPEAR++
                following = observation.next_weight_update if options["next_layer"] else None
                extra = {} if following is None else {"next_weight_grad": following}
                if steps > 1:  # FedAvg's drift
                    extra["local_steps"] = steps
                return attack.invert(*gradients, weight=weight, bias=bias, batch_size=known, **extra)
            return attack.invert(*gradients, weight=weight, bias=bias, batch_size=known)
        if observation.gradients is None or not isinstance(data, ImageData):
            raise ValueError(f"{method} needs every parameter's gradient of an image batch (section 'full')")
        tv_weight = options["ig_tv_weight"] if spec.options["tv"] else 0.0
        schedule = {key: options[f"ig_{key}"] for key in ("iterations", "restarts")}
        baseline = InvertingGradients(**schedule, tv_weight=tv_weight, seed=trial.seed, time_budget=budget)
        return baseline.invert(
            observation.gradients,
            model=trial.model,
            labels=trial.labels,
            input_shape=data.image_shape,
            data_mean=data.mean,
            data_std=data.std,
        )


def _error_text(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".replace("\n", " ")[:_ERROR_CHARS]


def attack_and_score(
    setting: Setting,
    method: str,
    observation: Observation,
    *,
    trial: Trial,
    data: Data,
    options: Mapping[str, Any],
) -> Outcome:
    """Attack one observation with one method and score it; never raises for a failing attack."""
    outcome = Outcome(method, setting.cell.batch_size, 0.0, metrics=dict(observation.facts))
    if setting.section == "secagg":
        outcome.metrics |= client_recovery(None, setting)
    start, cpu_start = time.perf_counter(), time.process_time()
    try:
        rec = invert(method, observation, trial=trial, data=data, options=options)
        outcome.seconds, outcome.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        outcome.ok, scores = score(setting, rec, observation, data)
    except Exception as error:  # a failed attack is a data point
        outcome.seconds, outcome.cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        outcome.error = _error_text(error)
        return outcome
    outcome.metrics |= scores
    outcome.found, outcome.complete = rec.found, bool(rec.complete)
    outcome.sparsity_matching = float(rec.sparsity_matching)
    return outcome


# --------------------------------------------------------------------------- data


def load_data(settings: Sequence[Setting]) -> dict[tuple[str, str | None], Data]:
    """Every dataset the settings need, training split.

    Raises
    ------
    DatasetUnavailable
        For the first dataset that cannot be loaded; one line naming it and how to get it.
    """
    loaded: dict[tuple[str, str | None], Data] = {}
    for key in dict.fromkeys((s.dataset, s.data_root) for s in settings):
        name, root = key
        try:
            if name == "adult":
                loaded[key] = load_adult(root=root, split="train")
                continue
            images = load_dataset(name, root=root, split="train")
        except FileNotFoundError as error:
            raise DatasetUnavailable(dataset_missing(name, error)) from error
        except (ValueError, OSError) as error:
            raise DatasetUnavailable(
                f"{name} ({root or 'searched'}): {str(error).splitlines()[0]}"
            ) from error
        # a flat image folder has one label; the victim needs two outputs
        loaded[key] = images if images.num_classes >= 2 else dataclasses.replace(images, num_classes=2)
    return loaded


def csv_fields(settings: Sequence[Setting], data: Datasets) -> list[str]:
    """The CSV columns of a run: identity, parameters, facts, outcome and scores."""
    params = [key for s in settings for key in s.params]
    facts = [key for s in settings for key in FACTS.get(s.section, ())]
    metrics = [key for s in settings for key in metric_fields(s, data[s.data_key])]
    head = ["section", "dataset", "b", "m", "trial", "seed", *params, *facts, "method", "ok", *metrics]
    tail = ["seconds", "cpu_seconds", "found", "batch_size", "complete", "sparsity_matching", "error"]
    return list(dict.fromkeys(head + tail))


# --------------------------------------------------------------------------- running


@dataclass
class SettingResult:
    """The outcomes of one setting by method; how many trials were observed, and the last reason
    why one could not be (an update that cannot be formed is a failed batch of every method)."""

    setting: Setting
    outcomes: dict[str, list[Outcome]] = field(default_factory=dict)
    observed: int = 0
    unobservable: str = ""


def _progress(context: str, outcome: Outcome) -> str:
    shown = [
        f"{key}={outcome.metrics[key]:.4g}"
        for key in ("mean_psnr", "discrete_accuracy", "mae")
        if isinstance(outcome.metrics.get(key), float)
    ]
    line = (
        f"{context} {outcome.method}: ok={int(outcome.ok)} {' '.join(shown)} {outcome.seconds:.2f} s "
        f"found {outcome.found}/{outcome.batch_size} complete={int(outcome.complete)}"
    )
    return line + (f" error={outcome.error}" if outcome.error else "")


def warm_up(settings: Sequence[Setting], data: Datasets, *, options: Mapping[str, Any]) -> None:
    """Attack a small untimed batch once per method, so that one-time set-up (imports, JIT:
    several seconds) is not charged to the first timed batch."""
    setting = dataclasses.replace(settings[0], cell=_WARM_UP)
    trial = draw_trial(data[setting.data_key], setting, index=0, seed=10_000)
    observation = observe(setting, trial, data[setting.data_key])
    quick = {**options, "time_budget": 10.0, "spear_time_budget": None, "hard_limit_slack": 10.0}
    for method in dict.fromkeys(m for s in settings for m in s.methods):
        attack_and_score(
            setting, method, observation, trial=trial, data=data[setting.data_key], options=quick
        )


def run_settings(
    settings: Sequence[Setting],
    data: Datasets,
    *,
    options: Mapping[str, Any],
    writer: ResultsWriter,
    log: TextIO = sys.stderr,
) -> list[SettingResult]:
    """Attack every setting on its trials; one CSV row and one progress line per attacked batch."""
    results = [SettingResult(s, {m: [] for m in s.methods}) for s in settings]
    groups: dict[Any, list[SettingResult]] = {}
    for result in results:
        groups.setdefault(result.setting.victim_key, []).append(result)
    for group in groups.values():
        first = group[0].setting
        dataset = data[first.data_key]
        for index in range(max(result.setting.trials for result in group)):
            seed = int(options["seed"]) + index
            trial = draw_trial(dataset, first, index=index, seed=seed)
            for result in group:
                setting = result.setting
                if index >= setting.trials:
                    continue
                identity = {**setting.fields, "trial": index, "seed": seed}
                context = " ".join(f"{k}={v}" for k, v in identity.items() if k not in ("trial", "seed"))
                context += f" trial {index + 1}/{setting.trials}"
                try:
                    observation: Observation | None = observe(setting, trial, dataset)
                    result.observed += 1
                except Exception as error:  # e.g. a layer without a ReLU; a failed batch like any other
                    observation, result.unobservable = None, str(error).replace("\n", " ")
                for method in setting.methods:
                    if observation is None:
                        failed = f"update: {result.unobservable}"[:_ERROR_CHARS]
                        outcome = Outcome(method, setting.cell.batch_size, 0.0, error=failed)
                    else:
                        outcome = attack_and_score(
                            setting, method, observation, trial=trial, data=dataset, options=options
                        )
                    result.outcomes[method].append(outcome)
                    writer.add({**identity, **outcome.record()})
                    print(_progress(context, outcome), file=log, flush=True)
    return results


def summary_rows(results: Sequence[SettingResult], *, family: str) -> list[dict[str, Any]]:
    """One row per (setting, method): parameters, our summary, the paper's numbers beside it."""
    rows = []
    for result in results:
        fields = result.setting.fields
        for method in result.setting.methods:
            paper = published(family, method=method, **fields)
            row = {**fields, "label": paper.get("label", fields["dataset"]), "method": method}
            row |= {"method_label": METHODS[method].label, **{f"paper_{k}": v for k, v in paper.items()}}
            if not result.observed:
                rows.append({**row, "status": f"not attackable: {result.unobservable}"})
                continue
            summary = summarize(result.outcomes[method])
            rows.append({**row, "status": "run", **summary, "threshold_db": result.setting.threshold_db})
    return rows
