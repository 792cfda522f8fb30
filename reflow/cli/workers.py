"""`reflow workers`: what the running workers hold and refuse."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any

import typer

from reflow.cli.common import fail, load_settings

if TYPE_CHECKING:
    from reflow.v1 import worker_pb2

app = typer.Typer(help="The running workers.", no_args_is_help=True)


@app.command("status")
def workers_status(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON array.")] = False,
) -> None:
    """Each worker: loaded versions, queue, memory, its isolation and the connections it refused."""
    from reflow.v1 import worker_pb2  # grpc, protobuf: 60 ms off `reflow --help`
    from reflow.worker_calls import WorkerTargets, call_workers

    settings = load_settings()
    statuses = call_workers(
        WorkerTargets.from_settings(settings), "Status", worker_pb2.WorkerStatusRequest(), timeout_s=5
    )
    if not statuses:
        fail("no workers: set REFLOW_WORKERS or start `reflow up` in this data dir")
    rows: list[dict[str, Any]] = []
    for address, status in statuses.items():
        if isinstance(status, str):
            rows.append({"address": address, "error": status})
            continue
        rows.append({
            "address": address, "isolation": status.isolation,
            "connections_dropped": status.connections_dropped, "connects_denied": status.connects_denied,
            "running": status.running, "waiting": status.waiting, "memory_bytes": status.memory_bytes,
            "kv_blocks_used": status.kv_blocks_used, "kv_blocks_total": status.kv_blocks_total,
            "kv_blocks_cached": status.kv_blocks_cached,
            "prefix_cache_hit_rate": status.prefix_cache_hit_rate,
            "loaded": [{"model": v.model, "version": v.version, "aliases": list(v.aliases), "dtype": v.dtype,
                        "base_version": v.base_version, "adapter_parameters": v.adapter_parameters,
                        "dtype_candidates": [_candidate(c) for c in v.dtype_candidates]}
                       for v in status.loaded],
        })  # fmt: skip
    if as_json:
        print(json.dumps(rows))
    else:
        for row in rows:
            if "error" in row:
                print(f"{row['address']}\tunreachable: {row['error']}")
                continue
            served = ", ".join(f"{v['model']}/{v['version']}" + "".join(f" @{a}" for a in v["aliases"])
                               + (f" (adapter over v{v['base_version']})" if v["base_version"] else "")
                               + f" {v['dtype']}" + _measured(v["dtype_candidates"])
                               for v in row["loaded"])  # fmt: skip
            print(f"{row['address']}\t{served or '-'}\trunning {row['running']}, waiting {row['waiting']}, "
                  f"KV blocks {row['kv_blocks_used']}/{row['kv_blocks_total']} "
                  f"({row['kv_blocks_cached']} cached, hit rate {row['prefix_cache_hit_rate']:.0%})\t"
                  f"isolation {row['isolation']}: {row['connections_dropped']} connections dropped, "
                  f"{row['connects_denied']} connects denied")  # fmt: skip
    if any("error" in row for row in rows):
        raise typer.Exit(1)


def _candidate(candidate: worker_pb2.DtypeCandidate) -> dict[str, Any]:
    """A DtypeCandidate as JSON: its step time at each row count timed."""
    return {
        "dtype": candidate.dtype, "rows": list(candidate.rows),
        "step_ms": [round(ms, 2) for ms in candidate.step_ms],
        "token_agreement": candidate.token_agreement if candidate.HasField("token_agreement") else None,
        "chosen": candidate.chosen,
    }  # fmt: skip


def _measured(candidates: list[dict[str, Any]]) -> str:
    """What REFLOW_DTYPE=auto timed, for the text listing: each dtype's step at each row count."""
    if not candidates:
        return ""
    timed = "; ".join(f"{c['dtype']} " + ", ".join(f"{ms:.1f} ms" for ms in c["step_ms"]) for c in candidates)
    rows = "/".join(str(n) for n in candidates[0]["rows"])
    return f" (auto: a step of {rows} rows took {timed})"
