"""Fills an empty registry: trains the demo base model and registers it as version 1, `champion`."""

from __future__ import annotations

import logging
import random
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feedback.tasks import arith
from feedback.training.pretrain import PretrainConfig, train_base_model
from reflow.registry import Registry, VersionRef
from reflow.settings import Settings
from workers.models.builtin import Transformer
from workers.models.byte_tokenizer import ByteTokenizer
from workers.models.loader import resolve_device

logger = logging.getLogger(__name__)
EVAL_PROBLEMS = 500
EVAL_SEED = 1234
WIDE_RANGE = (0, 99)


def evaluate(model: Transformer, config: PretrainConfig) -> dict[str, float]:
    """Greedy accuracy on seeded in-range and wide-range (0-99) problems."""
    tokenizer = ByteTokenizer()
    in_range = arith.sample_operands(EVAL_PROBLEMS, config.lo, config.hi, random.Random(EVAL_SEED))
    wide = arith.sample_operands(EVAL_PROBLEMS, *WIDE_RANGE, random.Random(EVAL_SEED + 1))
    return {
        "accuracy_in_range": arith.accuracy(model, tokenizer, in_range),
        "accuracy_wide_range": arith.accuracy(model, tokenizer, wide),
    }


def pretrain_config(settings: Settings) -> PretrainConfig:
    """The base model's training recipe: the defaults, with the settings' preset and step count."""
    config = replace(PretrainConfig(), preset=settings.model_preset)
    return replace(config, steps=settings.bootstrap_steps) if settings.bootstrap_steps else config


def ensure_base_model(settings: Settings, registry: Registry, console: Console) -> VersionRef:
    """The version behind the serving alias; trains and registers the base model when there is none."""
    name, alias = settings.model_name, settings.model_alias
    if registry.has_alias(name, alias):
        return registry.resolve(name, alias=alias)
    config = pretrain_config(settings)
    device = resolve_device(settings.device)
    columns = (
        TextColumn("[bold]training base model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    started = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        task = progress.add_task("train", total=config.steps, loss=float("nan"))
        model = train_base_model(
            config, device, lambda step, _total, loss: progress.update(task, completed=step, loss=loss)
        )
    train_s = time.perf_counter() - started
    with console.status("evaluating the base model"):
        metrics = {**evaluate(model, config), "train_seconds": train_s}
    console.print(
        f"base model: in-range accuracy {metrics['accuracy_in_range']:.1%}, wide-range (0-99) "
        f"{metrics['accuracy_wide_range']:.1%}, trained in {train_s:.0f}s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        model.save(directory)
        ByteTokenizer().save(directory)
        return registry.register(
            name,
            directory,
            params={**asdict(config), "device": str(device)},
            metrics=metrics,
            alias=alias,
            tags={"reflow.source": "bootstrap"},
        )
