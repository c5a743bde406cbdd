"""Every use of ipyparallel's private API in mpnb, in one place.

ipyparallel has no public call that sends one execute request to one engine
with a hook that runs before the message leaves, and none that exposes the
connection file a client was built from. mpnb needs both; when an ipyparallel
release changes these names, this module is the one to fix. Tested against
ipyparallel 9.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import ipyparallel as ipp


def send_execute(
    client: ipp.Client,
    engine_id: int,
    code: str,
    *,
    metadata: dict[str, Any],
    before_send: Callable[[Any], None],
) -> Any:
    """Send `code` to one engine as an execute request; returns its future.

    `before_send(future)` runs before the request is sent, so callbacks it
    registers miss nothing the engine publishes. The request goes out on the
    client's mux stream, as a DirectView's does: a raw-socket send can starve
    the stream's reads.
    """
    idents, _ = client._build_targets(engine_id)
    return client.send_execute_request(
        client._mux_stream,
        code,
        silent=False,
        ident=idents[0],
        metadata=metadata,
        message_future_hook=before_send,
    )


def forget_output(client: ipp.Client, msg: dict[str, Any]) -> None:
    """Drop ipyparallel's own copy of a stream or display message, once mpnb has taken it.

    ipyparallel appends every stream message to `client.metadata[msg_id]` (copying the whole text
    so far each time) and keeps every display until the request is done: a cell that prints 200 MiB
    would hold 200 MiB in the kernel while it runs, and many messages cost quadratic time (2 000
    messages of 100 KB: over 2 minutes). mpnb shows output through its own capped callbacks, so the
    copy is not needed."""
    md = client.metadata.get(msg["parent_header"].get("msg_id"))
    if md is None:
        return
    if msg["header"]["msg_type"] == "stream":
        md[msg["content"]["name"]] = ""
    else:
        md["outputs"] = []


def connection_config(client: ipp.Client) -> dict[str, Any]:
    """The client's connection info (`registration`, `interface`, `location`, ...); {} if unknown."""
    return getattr(client, "_config", None) or {}
