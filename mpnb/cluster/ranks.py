"""Forming a world: rank the engines from their metadata, then set up torch.distributed on each.

Ranks come from (host, GPU, pid), never from engine ids, which change on restart;
local ranks count within each host so LOCAL_RANK is right across machines.

Kernel side: never imports torch.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from mpnb.cluster.session import RankInfo
from mpnb.errors import ClusterError
from mpnb.execution import ipp_private

if TYPE_CHECKING:
    import ipyparallel as ipp

    from mpnb.cluster.launch import WorldPlan
    from mpnb.planning.config import Config


def wait_all(results: list[Any], timeout: float, what: str) -> list[Any]:
    """Wait for per-engine AsyncResults; raise at the first failure instead of waiting for the rest."""
    deadline = time.monotonic() + timeout
    pending = list(range(len(results)))
    while pending:
        for i in list(pending):
            ar = results[i]
            if ar.ready():
                pending.remove(i)
                if not ar.successful():
                    try:
                        ar.get()
                    except Exception as exc:
                        raise ClusterError(
                            f"{what} failed on engine {ar.engine_id}: {short_error(exc)}"
                        ) from exc
        if pending:
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"{what} did not finish within {timeout:g} s on engines "
                    f"{[results[i].engine_id for i in pending]}."
                )
            results[pending[0]].wait(0.01)
    return [ar.get() for ar in results]


def short_error(exc: BaseException) -> str:
    """`Name: message` of a local or remote error, for a one-line message without the engine's traceback."""
    ename = getattr(exc, "ename", type(exc).__name__)
    evalue = getattr(exc, "evalue", str(exc))
    return f"{ename}: {evalue}"


def controller_ip(client: ipp.Client) -> str | None:
    """The controller's host from the client's registration URL, or None when it is not known."""
    url = ipp_private.connection_config(client).get("registration", "") or ""
    host = url.rpartition("//")[2].rpartition(":")[0]
    return host or None


def assign_ranks(infos: dict[int, dict[str, Any]], plan: WorldPlan) -> list[dict[str, Any]]:
    """Order engines by (host, GPU, pid) and number them; local ranks count within each host, and
    each host's node rank (torchrun's GROUP_RANK) is its place in that order."""
    order = sorted(
        infos,
        key=lambda eid: (
            infos[eid]["host"],
            infos[eid]["gpus"][0] if len(infos[eid]["gpus"]) == 1 else -1,
            infos[eid]["pid"],
        ),
    )
    per_host: dict[str, list[int]] = {}
    for eid in order:
        per_host.setdefault(infos[eid]["host"], []).append(eid)

    hosts = list(per_host)  # in rank order
    rows = []
    for rank, eid in enumerate(order):
        info = infos[eid]
        same_host = per_host[info["host"]]
        local_rank = same_host.index(eid)
        if plan.devices is not None:
            gpu: int | None = plan.devices[rank]
        elif plan.cpu_only:
            gpu = None
        elif len(info["gpus"]) == 1:
            gpu = info["gpus"][0]  # the launcher already gave this engine one GPU
        elif len(info["gpus"]) >= len(same_host):
            gpu = info["gpus"][local_rank]
        elif info["gpus"]:
            raise ClusterError(
                f"Host {info['host']} runs {len(same_host)} engines but sees only {len(info['gpus'])} GPUs. "
                "Start one engine per GPU there, or use `--backend gloo`."
            )
        else:
            gpu = None
        rows.append(
            {
                "rank": rank,
                "engine_id": eid,
                "info": info,
                "local_rank": local_rank,
                "local_world_size": len(same_host),
                "group_rank": hosts.index(info["host"]),
                "group_world_size": len(hosts),
                "gpu": gpu,
            }
        )
    return rows


def form_world(
    client: ipp.Client, engine_ids: list[int], plan: WorldPlan, config: Config
) -> tuple[list[RankInfo], str]:
    """Rank the engines, then run `bootstrap.setup` on all of them at once."""
    from mpnb.engine import bootstrap

    if not engine_ids:
        raise ClusterError("The cluster has no engines. Start some (e.g. `ipcluster start -n 2`) and retry.")
    controller_addr = controller_ip(client)
    info_results = [client[eid].apply_async(bootstrap.engine_info, controller_addr) for eid in engine_ids]
    infos = dict(zip(engine_ids, wait_all(info_results, 60.0, "Reading engine information"), strict=True))

    rows = assign_ranks(infos, plan)
    gpus_used = [r["gpu"] for r in rows]
    backend = plan.backend or ("nccl" if all(g is not None for g in gpus_used) else "gloo")
    if backend == "nccl" and any(g is None for g in gpus_used):
        raise ClusterError(
            "The nccl backend needs a GPU on every rank; some ranks have none. Use `--backend gloo`."
        )
    plan.backend = backend

    hosts = {r["info"]["host"] for r in rows}
    rank0 = rows[0]["info"]
    master_addr = "127.0.0.1" if len(hosts) == 1 else rank0["ip"]
    if plan.port:
        master_port = plan.port
    elif len(hosts) == 1:
        master_port = rank0["free_port"]  # probed on 127.0.0.1, where rank 0's store will listen
    else:  # probe on the address rank 0 will serve the store on
        master_port = client[rows[0]["engine_id"]].apply_sync(bootstrap.free_port, master_addr)

    setup_results = [
        client[r["engine_id"]].apply_async(
            bootstrap.setup,
            rank=r["rank"],
            world_size=len(rows),
            local_rank=r["local_rank"],
            local_world_size=r["local_world_size"],
            group_rank=r["group_rank"],
            group_world_size=r["group_world_size"],
            master_addr=master_addr,
            master_port=master_port,
            backend=backend,
            gpu=r["gpu"],
            timeout_s=plan.timeout_s,
            config=config.to_dict(),
        )
        for r in rows
    ]
    done = wait_all(setup_results, plan.timeout_s + 60.0, "Setting up torch.distributed")
    ranks = [
        RankInfo(
            rank=r["rank"],
            engine_id=r["engine_id"],
            host=r["info"]["host"],
            pid=r["info"]["pid"],
            started=r["info"].get("started"),
            device=d["device"],
            local_rank=r["local_rank"],
            gpu=r["gpu"],
            nannies=tuple(r["info"].get("nannies", ())),
            nanny_started=tuple(r["info"].get("nanny_started", ())),
            stacks=str(r["info"].get("stacks", "")),
            log=str(r["info"].get("log", "")),
            address=str(r["info"].get("ip", "")),
        )
        for r, d in zip(rows, done, strict=True)
    ]
    return ranks, backend
