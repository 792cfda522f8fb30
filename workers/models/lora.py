"""Low-rank adapters (LoRA) over a model's linear layers: their weights in PEFT's format, merged
into the base weights, or applied per batch row so that rows of several adapters and rows of
none share one forward of the base model.

A target linear layer computes `y = x W^T + b + scale * (x A^T) B^T` (Hu et al., 2021), with
A [r, in], B [out, r] and scale = alpha / r (alpha / sqrt(r) with rsLoRA), as peft's
`tuners/lora/layer.py` does. On disk an adapter is what peft writes: `adapter_config.json` and
`adapter_model.safetensors` with tensors named `base_model.model.<module>.lora_A.weight` (and
`lora_B`), `<module>` as the base model's Hugging Face names, so the same files load in
transformers + peft, vLLM or LoRAX.

Serving several adapters in one batch (vLLM's Punica kernels do it on CUDA) is two small dense
GEMMs per target here: every loaded adapter's A is stacked into [S*r, in] and B into [out, S*r];
each row's mask keeps only its own adapter's r columns of `x A^T` (scaled), so a row without an
adapter adds exactly zero and the GEMM over the stacks reads each adapter's weights once.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from workers.models.linears import PackedLinear, StackedLinear

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEFT_PREFIX = "base_model.model."  # peft's prefix before the base model's own module names
# adapter_config.json keys whose non-default values change the arithmetic, which reflow does not do
UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "rank_pattern": {},
    "alpha_pattern": {},
}


@dataclass(frozen=True)
class LoraConfig:
    """An adapter's shape: rank, alpha, and the base modules it adapts (by their last name part)."""

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = ALL_LINEAR
    rslora: bool = False  # scale alpha / sqrt(rank) instead of alpha / rank

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"a LoRA rank must be at least 1, got {self.rank}")
        if not self.targets:
            raise ValueError("a LoRA adapter needs at least one target module")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def to_peft(self, base_model: str) -> dict[str, Any]:
        """adapter_config.json as peft writes it for a causal LM."""
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": self.rank, "lora_alpha": self.alpha, "target_modules": sorted(self.targets),
            "lora_dropout": 0.0, "use_rslora": self.rslora, "inference_mode": True,
            "init_lora_weights": True, "modules_to_save": None, **UNSUPPORTED,
        }  # fmt: skip

    @classmethod
    def from_peft(cls, config: Mapping[str, Any]) -> LoraConfig:
        """Reads adapter_config.json; ValueError for an adapter reflow cannot apply exactly."""
        if config.get("peft_type", "LORA") != "LORA":
            raise ValueError(f"peft_type {config.get('peft_type')!r} is not LORA")
        for key, default in UNSUPPORTED.items():
            if config.get(key) not in (default, None):
                raise ValueError(
                    f"adapter_config.json sets {key}={config[key]!r}; reflow applies only {default!r}"
                )
        if config.get("modules_to_save"):
            raise ValueError("adapter_config.json has modules_to_save; reflow loads only LoRA weights")
        targets = config.get("target_modules") or ()
        if isinstance(targets, str):  # peft allows a regex or "all-linear"
            if targets != "all-linear":
                raise ValueError(f"target_modules {targets!r}: reflow takes a list of module names")
            targets = ALL_LINEAR
        return cls(
            int(config["r"]), float(config["lora_alpha"]), tuple(targets), bool(config.get("use_rslora"))
        )


def target_modules(
    model: nn.Module, targets: Iterable[str]
) -> dict[str, tuple[nn.Linear | PackedLinear, int]]:
    """The linear layers of `model` whose last name part is a target (`adaptable_linears`)."""
    wanted = set(targets)
    found = {
        name: found for name, found in adaptable_linears(model).items() if name.rsplit(".", 1)[-1] in wanted
    }
    if not found:
        raise ValueError(f"the model has no linear layer named {', '.join(sorted(wanted))} to adapt")
    return found


@dataclass
class Adapter:
    """One adapter's weights: A [r, in] and B [out, r] per adapted module, by its full name."""

    config: LoraConfig
    weights: dict[str, tuple[Tensor, Tensor]]

    @classmethod
    def new(cls, model: nn.Module, config: LoraConfig, seed: int = 0) -> Adapter:
        """A trainable adapter that changes nothing yet: A as peft initialises it (Kaiming-uniform,
        as nn.Linear's weights), B zero; float32 on the model's device."""
        generator = torch.Generator().manual_seed(seed)
        weights = {}
        for name, (linear, out_features) in sorted(target_modules(model, config.targets).items()):
            if not isinstance(linear, nn.Linear):
                raise ValueError("a model packed for serving is not trained: train the model as loaded")
            bound = 1.0 / math.sqrt(linear.in_features)  # kaiming_uniform_(a=sqrt(5))'s bound
            a = (torch.rand(config.rank, linear.in_features, generator=generator) * 2 - 1) * bound
            b = torch.zeros(out_features, config.rank)
            device = linear.weight.device
            weights[name] = (a.to(device).requires_grad_(), b.to(device).requires_grad_())
        return cls(config, weights)

    def trainable_copy(self) -> Adapter:
        """A float32 copy of its tensors that an optimizer can train, leaving this one as it is."""
        weights = {
            name: (a.detach().float().clone().requires_grad_(), b.detach().float().clone().requires_grad_())
            for name, (a, b) in self.weights.items()
        }
        return Adapter(self.config, weights)

    def parameters(self) -> list[Tensor]:
        """Its tensors, for an optimizer."""
        return [t for pair in self.weights.values() for t in pair]

    def parameter_count(self) -> int:
        return sum(t.numel() for t in self.parameters())

    def to(self, device: torch.device, dtype: torch.dtype) -> Adapter:
        """A copy on `device` in `dtype`, without gradients: for serving."""
        weights = {
            n: (a.detach().to(device, dtype), b.detach().to(device, dtype))
            for n, (a, b) in self.weights.items()
        }
        return Adapter(self.config, weights)

    def rows(self, n_rows: int) -> AdapterRows:
        """This adapter on every one of `n_rows` rows (training and evaluation): its own tensors, so
        gradients reach them."""
        a = next(iter(self.weights.values()))[0]
        mask = torch.full((n_rows, 1, self.config.rank), self.config.scale, device=a.device, dtype=a.dtype)
        return AdapterRows(self.weights, mask)

    def check(self, model: nn.Module) -> None:
        """ValueError unless every adapted module is a linear layer of `model` (or a part of a
        stacked one) of the right shape."""
        linears = adaptable_linears(model)
        for name, (a, b) in self.weights.items():
            if name not in linears:
                raise ValueError(f"the adapter adapts {name}, which the base model has no linear layer for")
            linear, out_features = linears[name]
            in_features = linear.in_features
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise ValueError(
                    f"the adapter's {name} is {b.shape[0]}x{a.shape[1]}; the base model's is "
                    f"{out_features}x{in_features}"
                )

    @torch.no_grad()
    def merge_into(self, model: nn.Module) -> None:
        """Adds scale * B A to each adapted weight of `model` (a model as loaded: its projections
        separate), in place: the base with the adapter folded in (logits equal base + adapter to
        float rounding)."""
        self.check(model)
        modules = dict(model.named_modules())
        for name, (a, b) in self.weights.items():
            linear = modules.get(name)
            if not isinstance(linear, nn.Linear):
                raise ValueError(f"{name} is stacked with others for serving; merge into the model as loaded")
            weight = linear.weight
            delta = (b.float() @ a.float()) * self.config.scale  # [out, in]
            weight.copy_((weight.float() + delta.to(weight.device)).to(weight.dtype))

    def save(self, directory: Path, base_model: str) -> Path:
        """Writes the adapter in PEFT's format into `directory`."""
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for name, (a, b) in self.weights.items():
            tensors[f"{PEFT_PREFIX}{name}.lora_A.weight"] = a.detach().contiguous().cpu()
            tensors[f"{PEFT_PREFIX}{name}.lora_B.weight"] = b.detach().contiguous().cpu()
        save_file(tensors, str(directory / ADAPTER_WEIGHTS_FILE), metadata={"format": "pt"})
        text = json.dumps(self.config.to_peft(base_model), indent=2, sort_keys=True) + "\n"
        (directory / ADAPTER_CONFIG_FILE).write_text(text)
        return directory

    @classmethod
    def load(cls, directory: Path, device: torch.device, dtype: torch.dtype) -> Adapter:
        """The adapter peft (or reflow) saved in `directory`; ValueError for what is not LoRA."""
        config = LoraConfig.from_peft(json.loads((directory / ADAPTER_CONFIG_FILE).read_text()))
        halves: dict[str, dict[str, Tensor]] = {}
        with safe_open(str(directory / ADAPTER_WEIGHTS_FILE), framework="pt", device=str(device)) as f:
            for key in f.keys():  # noqa: SIM118  # safe_open has no __iter__
                module, dot, half = key.removeprefix(PEFT_PREFIX).rpartition(".lora_")
                if not dot or half not in ("A.weight", "B.weight"):
                    raise ValueError(f"{directory / ADAPTER_WEIGHTS_FILE} holds {key}, not a LoRA weight")
                halves.setdefault(module, {})[half[0]] = f.get_tensor(key).to(dtype)
        weights = {}
        for module, pair in halves.items():
            if (
                set(pair) != {"A", "B"}
                or pair["A"].shape[0] != config.rank
                or pair["B"].shape[1] != config.rank
            ):
                raise ValueError(
                    f"the adapter's {module} is not a rank-{config.rank} pair of lora_A and lora_B"
                )
            weights[module] = (pair["A"], pair["B"])
        if not weights:
            raise ValueError(f"{directory / ADAPTER_WEIGHTS_FILE} holds no LoRA weights")
        return cls(config, weights)


@dataclass(frozen=True)
class AdapterRows:
    """The adapters of one forward: per adapted module the stacked A [S*R, in] and B [out, S*R] of
    every adapter in the set, and per row a mask [B, 1, S*R] that keeps its adapter's columns,
    scaled (zero for a row without one). R is the set's largest rank; smaller ones are zero-padded."""

    stacks: dict[str, tuple[Tensor, Tensor]]
    mask: Tensor

    def add(self, name: str, x: Tensor, y: Tensor) -> Tensor:
        """y (= linear(x)) plus each row's adapter update of module `name`."""
        stack = self.stacks.get(name)
        if stack is None:
            return y
        a, b = stack  # in the adapter's dtype (a trained one stays float32 over bfloat16 weights)
        update = ((x.to(a.dtype) @ a.T) * self.mask) @ b.T  # x [B, T, in] -> [B, T, S*R] -> [B, T, out]
        return y + update.to(y.dtype)


def project(linear: nn.Linear, x: Tensor, adapters: AdapterRows | None, name: str) -> Tensor:
    """linear(x), with each row's adapter update when there are adapters."""
    y = linear(x)
    return y if adapters is None else adapters.add(name, x, y)


def project_stacked(
    linear: nn.Module, x: Tensor, adapters: AdapterRows | None, parts: Mapping[str, int]
) -> tuple[Tensor, ...]:
    """The outputs of the linear layers `parts` (full name -> width) stacked into `linear` (a
    StackedLinear, or a quantized copy of one), each with each row's adapter update of its name:
    what each layer alone with its adapter gives."""
    outputs = linear(x).split(list(parts.values()), dim=-1)
    if adapters is None:
        return tuple(outputs)
    return tuple(adapters.add(name, x, y) for name, y in zip(parts, outputs, strict=True))


def adaptable_linears(model: nn.Module) -> dict[str, tuple[nn.Linear | PackedLinear, int]]:
    """Every linear layer of `model` an adapter can adapt, by full name, with its width (out
    features): each part of a stacked layer (packed or not) under its own name, with the layer that
    computes it."""
    found: dict[str, tuple[nn.Linear | PackedLinear, int]] = {}
    for name, module in model.named_modules():
        if isinstance(module, StackedLinear | PackedLinear) and module.parts:
            found.update({part: (module, width) for part, width in module.parts.items()})
        elif isinstance(module, nn.Linear | PackedLinear):
            found[name] = (module, module.out_features)
    return found


@dataclass
class AdapterSet:
    """The adapters served over one base version, each in a slot, stacked once per change."""

    adapters: list[Adapter] = field(default_factory=list)
    stacks: dict[str, tuple[Tensor, Tensor]] = field(init=False)
    rank: int = field(init=False)  # the largest adapter's: every slot is this wide

    def __post_init__(self) -> None:
        self._restack()

    def add(self, adapter: Adapter) -> int:
        """Adds an adapter (new tensors stacked; nothing recompiled); returns its slot."""
        self.adapters.append(adapter)
        self._restack()
        return len(self.adapters) - 1

    def remove(self, slot: int) -> None:
        """Drops the adapter in `slot`; later slots move down by one."""
        del self.adapters[slot]
        self._restack()

    def _restack(self) -> None:
        self.rank = rank = max((a.config.rank for a in self.adapters), default=0)
        names = sorted({n for adapter in self.adapters for n in adapter.weights})
        stacks = {}
        for name in names:
            a_like, b_like = next(ad.weights[name] for ad in self.adapters if name in ad.weights)
            absent = (a_like.new_zeros(0, a_like.shape[1]), b_like.new_zeros(b_like.shape[0], 0))
            a_parts, b_parts = [], []
            for adapter in self.adapters:
                a, b = adapter.weights.get(name, absent)  # absent: the adapter leaves it alone
                pad = rank - a.shape[0]
                a_parts.append(torch.cat([a, a.new_zeros(pad, a.shape[1])]) if pad else a)
                b_parts.append(torch.cat([b, b.new_zeros(b.shape[0], pad)], dim=1) if pad else b)
            stacks[name] = (torch.cat(a_parts), torch.cat(b_parts, dim=1))  # [S*R, in], [out, S*R]
        self.stacks = stacks

    def rows(self, slots: list[int | None]) -> AdapterRows | None:
        """The forward's adapters for rows using these slots (None: the base alone); None when no
        row uses one, so a batch of base rows runs the base model untouched."""
        if all(slot is None for slot in slots) or not self.stacks:
            return None
        a, _ = next(iter(self.stacks.values()))
        rank = self.rank
        mask = torch.zeros(len(slots), 1, len(self.adapters) * rank)  # [B, 1, S*R]
        for row, slot in enumerate(slots):
            if slot is not None:
                adapter = self.adapters[slot]
                mask[row, 0, slot * rank : slot * rank + adapter.config.rank] = adapter.config.scale
        return AdapterRows(self.stacks, mask.to(a.device, a.dtype))
