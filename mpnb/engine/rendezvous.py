"""The process group's rendezvous store, served by rank 0 on the ranks' address only.

torch's `tcp://` and `env://` rendezvous serve the store on every interface (`::`), unauthenticated:
anyone who reaches the host could read or rewrite the rendezvous keys. So rank 0 binds the address
the ranks use (loopback on one host) and hands the listening socket to the store. `bootstrap.setup`
forms mpnb's world with it, `own_group` every later group (re-formed, or a script's own).
"""

from __future__ import annotations

import contextlib
import os
import socket
from typing import Any


def listen(master_addr: str, port: int = 0) -> socket.socket:
    """A socket listening on `master_addr` only (port 0: one the system picks, free from now on)."""
    family, _, _, _, address = socket.getaddrinfo(master_addr, port, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address, family=family)


def store(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout: Any,
    listener: socket.socket | None = None,
) -> Any:
    """The TCPStore of a group: rank 0 serves it on `master_addr`:`master_port`, the others connect.

    `listener`: a socket rank 0 already listens on at that port (`own_group.agree_port` holds one
    from the moment the port is chosen, so nothing else can take it); the store takes it over.
    """
    from torch.distributed import TCPStore

    if rank != 0:
        return TCPStore(master_addr, master_port, world_size, False, timeout)
    if listener is None:
        listener = listen(master_addr, master_port)
    fd = listener.detach()  # the store owns and closes the fd from here on
    inode = os.fstat(fd).st_ino
    try:
        return TCPStore(master_addr, master_port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == inode:  # not yet taken (and closed) by the store
                os.close(fd)
        raise
