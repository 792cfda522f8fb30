"""Fills an empty registry: trains the demo base model and registers it as version 1, `champion`."""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from feedback.tasks import get_task
from feedback.training.evaluation import base_model_metrics, task_score_tags
from feedback.training.pretrain import PretrainConfig, train_base_model
from reflow.registry import Registry, VersionRef
from workers.models.loader import resolve_device, save_checkpoint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BaseModelSpec:
    """The model an empty registry gets: its name and alias, the task it learns, the recipe, where."""

    model: str
    alias: str
    task: str
    recipe: PretrainConfig
    device: str
    variants: tuple[str, ...] = ()  # REFLOW_VARIANTS: scored on the task too


def ensure_base_model(base: BaseModelSpec, registry: Registry, console: Console) -> VersionRef:
    """The version behind the serving alias; trains and registers the base model when there is none."""
    name, alias = base.model, base.alias
    if registry.has_alias(name, alias):
        return registry.resolve(name, alias=alias)
    config = base.recipe
    task = get_task(base.task)
    device = resolve_device(base.device)
    columns = (
        TextColumn("[bold]training base model"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
        TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn(),
    )  # fmt: skip
    started = time.perf_counter()
    with Progress(*columns, console=console, transient=False) as progress:
        bar = progress.add_task("train", total=config.steps, loss=float("nan"))
        model, tokenizer = train_base_model(
            config, task, device, lambda step, _total, loss: progress.update(bar, completed=step, loss=loss)
        )
    train_s = time.perf_counter() - started
    with console.status("evaluating the base model"):
        metrics = {**base_model_metrics(model, tokenizer, task), "train_seconds": train_s}
        scores = task_score_tags(model, tokenizer, task, base.variants) if base.variants else {}
    console.print(
        f"base model: {task.name} accuracy {metrics['accuracy_in_range']:.1%} on its training range, "
        f"{metrics['accuracy_wide_range']:.1%} on live traffic's, trained in {train_s:.0f}s"
    )
    with tempfile.TemporaryDirectory() as tmp:
        return registry.register(
            name,
            save_checkpoint(model, tokenizer, Path(tmp)),
            params={**asdict(config), "task": repr(task), "device": str(device)},
            metrics=metrics,
            alias=alias,
            tags={"reflow.source": "bootstrap", **scores},
        )
