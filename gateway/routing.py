"""The worker pool: each worker's health and last reported status, and which workers can take a
model. What this gateway runs on each worker is placement's (gateway/placement.py, WorkerLoad)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

import grpc

from reflow.errors import InvalidArgument, NotFound, Unavailable
from reflow.mtls import open_channel
from reflow.registry import TENANT_ALIAS
from reflow.v1 import inference_pb2, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

STATUS_TIMEOUT_S = 2.0  # a status poll's deadline
MISSED_POLLS = 2  # status polls in a row a worker may let time out before it leaves routing


@dataclass(frozen=True)
class ModelSpec:
    """What a request asks for: a name and a version number or an alias."""

    name: str
    version: str = ""
    alias: str = ""

    @classmethod
    def parse(cls, text: str, default_name: str, default_alias: str) -> ModelSpec:
        """`name`, `name@alias` or `name/version`; empty = the default model."""
        text = text.strip()
        name, sep, rest = text.partition("@")
        if sep:
            spec = cls(name, alias=rest)
        else:
            name, sep, rest = text.partition("/")
            spec = cls(name, version=rest) if sep else cls(name, alias=default_alias)
        spec = cls(spec.name or default_name, spec.version, spec.alias)
        if (
            (sep and not rest)
            or any(c in spec.name + spec.alias + spec.version for c in "/@")
            or not spec.name
        ):
            raise InvalidArgument(f"model {text!r} is not of the form NAME, NAME@ALIAS or NAME/VERSION")
        if spec.version and not spec.version.isdigit():
            raise InvalidArgument(f"model version {spec.version!r} must be a number")
        return spec

    def __str__(self) -> str:
        return f"{self.name}/{self.version}" if self.version else f"{self.name}@{self.alias}"


@dataclass
class ServedVersion:
    """One version as the healthy workers serve it: its aliases, how many ready workers hold it, and
    its variants (REFLOW_VARIANTS) with the lowest agreements a worker measured for each."""

    version: str
    aliases: list[str] = field(default_factory=list)
    ready_workers: int = 0
    tenant: str = ""  # the tenant whose own version it is; "" = anyone's
    variants: dict[str, inference_pb2.ModelVariant] = field(default_factory=dict)

    def add(self, loaded: worker_pb2.LoadedVersion) -> None:
        """Counts one more worker holding the version as `loaded` reports it."""
        self.aliases = sorted({*self.aliases, *loaded.aliases})
        self.ready_workers += 1
        self.tenant = loaded.tenant
        if not holds_variants(loaded):
            return  # its reference alone, which is the version itself: listed beside variants only
        for v in loaded.variants:
            seen = self.variants.get(v.name)
            self.variants[v.name] = inference_pb2.ModelVariant(
                name=v.name,
                greedy_agreement=min(v.greedy_agreement, seen.greedy_agreement if seen else 1.0),
                token_agreement=min(v.token_agreement, seen.token_agreement if seen else 1.0),
                task_score=_lowest(v, seen),
            )


def holds_variants(loaded: worker_pb2.LoadedVersion) -> bool:
    """Whether a worker holds variants of `loaded` beside its reference copy (REFLOW_VARIANTS):
    where it holds the reference alone, clients are told of no variants."""
    return len(loaded.variants) > 1


def _lowest(variant: worker_pb2.LoadedVariant, seen: inference_pb2.ModelVariant | None) -> float | None:
    """The lower of two workers' task scores of a variant, either one where only one has it."""
    scores = [m.task_score for m in (variant, seen) if m is not None and m.HasField("task_score")]
    return min(scores) if scores else None


@dataclass
class WorkerHandle:
    """One worker: its channel, its health and its last reported status."""

    address: str
    channel: grpc.aio.Channel
    stub: worker_pb2_grpc.WorkerStub
    loaded: list[worker_pb2.LoadedVersion] = field(default_factory=list)
    healthy: bool = False
    reported_running: int = 0  # sequences generating on it at its last status, from every gateway
    missed_polls: int = 0  # status polls in a row it let time out

    def serves(self, spec: ModelSpec) -> worker_pb2.LoadedVersion | None:
        """The loaded version matching `spec`, if this worker has one."""
        for loaded in self.loaded:
            if loaded.model == spec.name and (
                loaded.version == spec.version if spec.version else spec.alias in loaded.aliases
            ):
                return loaded
        return None


class WorkerPool:
    """Polls workers' status and routes each request to a healthy worker holding its version."""

    def __init__(
        self, addresses: list[str], poll_s: float, credentials: grpc.ChannelCredentials | None = None
    ):
        self.poll_s = poll_s
        self.credentials = credentials  # mTLS toward the workers; None = plaintext
        self.workers = [self._connect(a) for a in addresses]
        self._poller: asyncio.Task[None] | None = None

    def _connect(self, address: str) -> WorkerHandle:
        channel = open_channel(address, self.credentials, grpc.aio)
        return WorkerHandle(address, channel, worker_pb2_grpc.WorkerStub(channel))

    async def start(self) -> None:
        """Fetches every worker's status once, then keeps refreshing in the background."""
        await self.refresh()
        self._poller = asyncio.create_task(self._poll(), name="worker-poll")

    async def refresh(self) -> None:
        """Asks every worker for its status; a worker that does not answer is marked unhealthy."""
        await asyncio.gather(*(self.refresh_one(w) for w in self.workers))

    async def refresh_one(self, worker: WorkerHandle) -> None:
        """Asks one worker for its status; marks it unhealthy when it refuses or fails the call, or
        lets MISSED_POLLS in a row time out (one slow answer, from a busy worker or a busy gateway,
        does not take a worker that serves out of routing)."""
        try:
            status = await worker.stub.Status(worker_pb2.WorkerStatusRequest(), timeout=STATUS_TIMEOUT_S)
        except grpc.aio.AioRpcError as error:
            timed_out = error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            worker.missed_polls = worker.missed_polls + 1 if timed_out else MISSED_POLLS
            if worker.healthy and worker.missed_polls >= MISSED_POLLS:
                logger.warning("worker %s unavailable: %s", worker.address, error.code().name)
                worker.healthy = False
            return
        worker.missed_polls = 0
        if not worker.healthy:
            logger.info(
                "worker %s ready: %s", worker.address, [f"{v.model}/{v.version}" for v in status.loaded]
            )
        worker.loaded, worker.healthy, worker.reported_running = list(status.loaded), True, status.running

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()

    def mark_unhealthy(self, worker: WorkerHandle) -> None:
        """Takes a worker out of routing until its next successful status poll."""
        worker.healthy = False

    def candidates(
        self, spec: ModelSpec, exclude: frozenset[str] = frozenset()
    ) -> list[tuple[WorkerHandle, worker_pb2.LoadedVersion]]:
        """The healthy workers serving `spec` (but those in `exclude`), each with the version it
        serves for it; Unavailable or NotFound when there is none."""
        healthy = [w for w in self.workers if w.healthy and w.address not in exclude]
        if not healthy:
            raise Unavailable("no worker is available; check that `reflow worker` processes are running")
        candidates = [(w, v) for w in healthy if (v := w.serves(spec)) is not None]
        if not candidates:
            raise self.not_served(spec)
        return candidates

    def not_served(self, spec: ModelSpec) -> NotFound:
        """The error for `spec` when no worker serves it (or it is another tenant's own version:
        the same words, so a tenant cannot tell one from the other); it lists what anyone may ask
        for, never a tenant's own versions or aliases."""
        served = sorted(
            {
                f"{v.model}/{v.version} {[a for a in v.aliases if not TENANT_ALIAS.fullmatch(a)]}"
                for w in self.workers
                if w.healthy
                for v in w.loaded
                if not v.tenant
            }
        )
        return NotFound(f"no worker serves model {spec}; served now: {', '.join(served) or 'nothing'}")

    def serves(self, spec: ModelSpec, version: str = "") -> bool:
        """True when a healthy worker serves `spec` (as `version`, e.g. `@challenger` as v2)."""
        return any(
            w.healthy and (v := w.serves(spec)) is not None and version in ("", v.version)
            for w in self.workers
        )

    def served_versions(self) -> list[tuple[str, list[ServedVersion]]]:
        """Each model the healthy workers serve, by name, with its versions in number order."""
        models: dict[str, dict[str, ServedVersion]] = {}
        for worker in self.workers:
            if not worker.healthy:
                continue
            for v in worker.loaded:
                served = models.setdefault(v.model, {}).setdefault(v.version, ServedVersion(v.version))
                served.add(v)
        return [
            (name, sorted(versions.values(), key=lambda s: int(s.version)))
            for name, versions in sorted(models.items())
        ]

    async def close(self) -> None:
        """Stops polling and closes every channel."""
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        await asyncio.gather(*(w.channel.close() for w in self.workers))
