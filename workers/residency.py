"""A worker's catalog of residents: the versions it holds in memory, each with its copies (the
reference, as loaded, then its variants) and the LoRA adapters attached to it, and the one lookup
(name, version, copy) -> (copy, adapter slot) that tells the engine where a request runs.

The engine core (workers/engine.py) asks the catalog and queues the request on that copy's runner
(workers/runner.py); the copy's scheduler (workers/batch_scheduler.py) plans its steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import torch

from workers.grammar import Grammars
from workers.models.interface import CausalLM, Tokenizer
from workers.models.lora import Adapter


def dtype_name(model: CausalLM) -> str:
    """torch's name of a model's dtype, without the module: "float32", "bfloat16"."""
    return str(model.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Quality:
    """A copy as measured when its version loaded (workers/quality.py), against the version's
    reference copy on a fixed prompt set."""

    greedy_agreement: float  # share of the reference's greedy tokens it reproduces; 1 for the reference
    token_agreement: float  # share of them it predicts given the reference's tokens before each
    prefill_ms_per_token: float  # prompt tokens over time to first token, one prompt alone
    decode_ms_per_token: float  # time per later token, one sequence alone
    weight_bytes: int  # of its weights as held (int8 ones packed)


@dataclass(frozen=True)
class DtypeCandidate:
    """A dtype REFLOW_DTYPE=auto measured (workers/dtype_choice.py): the median milliseconds of a
    decode step at each row count timed, and its teacher-forced token agreement with float32."""

    dtype: str
    step_ms: tuple[float, ...]  # at each of DtypeChoice.rows
    token_agreement: float | None  # 1 for float32; None where not measured (a candidate not faster)


@dataclass(frozen=True)
class DtypeChoice:
    """What REFLOW_DTYPE=auto measured for a model's shape on this worker, and the dtype it serves."""

    rows: tuple[int, ...]  # sequences in the decode steps timed
    candidates: tuple[DtypeCandidate, ...]  # float32 first
    chosen: str

    def speedup(self, candidate: DtypeCandidate) -> float:
        """float32's step time over `candidate`'s: the geometric mean over the row counts."""
        ratios = [f / c for f, c in zip(self.candidates[0].step_ms, candidate.step_ms, strict=True)]
        return math.prod(ratios) ** (1 / len(ratios))


# A reference copy nobody measured (its version has no variants): agreement 1 by definition, speeds 0.
UNMEASURED_REFERENCE = Quality(1.0, 1.0, 0.0, 0.0, 0)


@dataclass(eq=False)
class Copy:
    """One copy of a resident version's weights, run on a KV pool of its own: the reference (the
    version as loaded) or a variant of it in another precision (workers/variants.py)."""

    name: str  # what a request names it by: the reference's dtype ("float32"), a variant's ("int8")
    model: CausalLM
    reference: bool = False
    max_len: int = 0  # longest prompt plus completion its pool holds, in tokens; 0 = the model's context
    quality: Quality | None = None  # None until measured (a version without variants never is)

    def __post_init__(self) -> None:
        self.max_len = self.max_len or self.model.max_seq_len


@dataclass(eq=False)
class ResidentVersion:
    """A registered version with weights of its own, in memory: its copies, the reference first,
    and the LoRA adapters attached to it."""

    name: str
    version: str
    model: CausalLM  # the reference copy's weights
    tokenizer: Tokenizer
    device: torch.device
    aliases: set[str] = field(default_factory=set)
    tenant: str = ""  # the tenant whose own version it is (reflow.registry.TENANT_TAG); "" = anyone's
    last_request: float = field(default_factory=time.monotonic)  # when a Generate last asked for it
    task_scores: dict[str, float] = field(default_factory=dict)  # by copy name, from its version's tags
    dtype_choice: DtypeChoice | None = None  # how REFLOW_DTYPE=auto chose its dtype; None: not measured
    copies: dict[str, Copy] = field(init=False)  # by name, the reference first
    adapters: dict[str, ResidentAdapter] = field(init=False, default_factory=dict)  # by version
    banned_tokens: torch.Tensor = field(init=False)  # [K] the ids it never generates (often none)
    grammars: Grammars = field(init=False)  # the structured outputs compiled for its vocabulary

    def __post_init__(self) -> None:
        reference = Copy(dtype_name(self.model), self.model, reference=True)
        self.copies = {reference.name: reference}
        vocab_size = self.model.vocab_size
        never = self.tokenizer.never_generated(vocab_size)
        self.banned_tokens = torch.tensor(never, dtype=torch.long, device=self.device)
        self.grammars = Grammars(self.tokenizer, vocab_size)

    @property
    def reference(self) -> Copy:
        """The copy as loaded, which the variants are measured against."""
        return next(iter(self.copies.values()))

    @property
    def max_len(self) -> int:
        """Longest prompt plus completion on its reference copy, in tokens."""
        return self.reference.max_len

    @property
    def base_version(self) -> str:
        """ "": a version with weights of its own is served over no other."""
        return ""

    @property
    def slot(self) -> str:
        """The adapter slot its requests run through: "", its copies' own weights."""
        return ""


@dataclass(eq=False)
class ResidentAdapter:
    """A LoRA adapter version attached to a resident version: served over its reference copy's
    weights, in the same steps and forwards."""

    version: str
    adapter: Adapter
    base: ResidentVersion
    aliases: set[str] = field(default_factory=set)
    tenant: str = ""
    last_request: float = field(default_factory=time.monotonic)
    task_scores: dict[str, float] = field(default_factory=dict)  # by copy name, from its version's tags

    @property
    def name(self) -> str:
        return self.base.name

    @property
    def base_version(self) -> str:
        """The version whose weights it is served over."""
        return self.base.version

    @property
    def model(self) -> CausalLM:
        return self.base.model

    @property
    def tokenizer(self) -> Tokenizer:
        return self.base.tokenizer

    @property
    def device(self) -> torch.device:
        return self.base.device

    @property
    def reference(self) -> Copy:
        return self.base.reference

    @property
    def max_len(self) -> int:
        return self.base.max_len

    @property
    def copies(self) -> dict[str, Copy]:
        """The one copy it is served over: its base's reference."""
        return {self.reference.name: self.reference}

    @property
    def slot(self) -> str:
        """The adapter slot its requests run through on the reference copy's runner: its version."""
        return self.version


Resident: TypeAlias = ResidentVersion | ResidentAdapter


class Route(NamedTuple):
    """Where a request runs: a copy of a version's weights, and the adapter slot on it ("" for none)."""

    copy: Copy
    adapter: str


class Residency:
    """Every resident of one worker by (model name, version), adapters beside the versions they
    attach to. One writer at a time (the engine holds its lock); readers get consistent snapshots."""

    def __init__(self) -> None:
        self._residents: dict[tuple[str, str], Resident] = {}

    def lookup(self, name: str, version: str, copy: str = "") -> Route | None:
        """The copy a request for `name`/`version` runs on and the adapter slot on it: the
        reference for "" or its own name (its dtype), else the variant named `copy`; None when
        either is not resident."""
        resident = self.get(name, version)
        if resident is None:
            return None
        found = resident.copies.get(copy or resident.reference.name)
        return None if found is None else Route(found, resident.slot)

    def get(self, name: str, version: str) -> Resident | None:
        """The resident version or adapter, or None."""
        return self._residents.get((name, version))

    def residents(self) -> list[Resident]:
        """Every resident, each version followed by its adapters."""
        residents: list[Resident] = []
        for resident in list(self._residents.values()):
            if isinstance(resident, ResidentVersion):
                residents += [resident, *list(resident.adapters.values())]
        return residents

    def admit(self, version: ResidentVersion) -> Resident | None:
        """Makes a version resident; returns the one it replaces (whose adapters go with it)."""
        replaced = self.remove(version.name, version.version)
        self._residents[(version.name, version.version)] = version
        return replaced

    def attach(self, adapter: ResidentAdapter) -> None:
        """Makes an adapter resident over its base version (resident already), in place of the same
        adapter version if it was."""
        adapter.base.adapters[adapter.version] = adapter
        self._residents[(adapter.name, adapter.version)] = adapter

    def add_variant(self, version: ResidentVersion, copy: Copy) -> Copy | None:
        """Holds a variant beside a resident version's reference; returns the one of the same name
        it replaces."""
        if copy.name == version.reference.name:
            raise ValueError(f"{copy.name} is {version.name}/{version.version}'s reference, not a variant")
        replaced = version.copies.pop(copy.name, None)
        version.copies[copy.name] = copy
        return replaced

    def remove(self, name: str, version: str) -> Resident | None:
        """Takes a resident out (a version's adapters with it); returns it, or None."""
        resident = self._residents.pop((name, version), None)
        if isinstance(resident, ResidentAdapter):
            resident.base.adapters.pop(version, None)
        elif resident is not None:
            for attached in list(resident.adapters):
                self._residents.pop((name, attached), None)
            resident.adapters.clear()
        return resident
