"""An SGLang general plugin: the torch.distributed stores SGLang's processes host listen on
their given host only, not on every interface.

SGLang's scheduler joins its process group with `init_process_group("tcp://127.0.0.1:PORT")`,
and torch's store for it listens on every interface whatever host it is given
(`rlhf.distributed.stores.bound_store` says why): an unauthenticated port, next to the HTTP
server that the API key guards. SGLang loads the general plugins registered under the
`sglang.srt.plugins` entry point at the start of each of its processes (`load_plugins()`:
the scheduler, the detokenizer, the engine). This one, registered in setup.py, acts only
where the launcher set `RLHF_SGLANG_BOUND_STORES=1` (the servers `rlhf.rollout.sglang_server`
starts): rank 0 of a tcp:// rendezvous then hosts its store on a socket bound to the URL's
host and port (127.0.0.1 for a one-node server; the address SGLang is given otherwise).
"""

from __future__ import annotations

import importlib
import os

ENV = "RLHF_SGLANG_BOUND_STORES"


def register() -> None:
    """SGLang's hook: wrap torch's tcp:// store creation in this process (idempotent)."""
    if os.environ.get(ENV) != "1":
        return
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    create = rendezvous._create_c10d_store
    if getattr(create, "binds_its_host", False):
        return

    def create_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        if rank != 0 or rendezvous._agent_store_serves(hostname, port):
            return create(hostname, port, rank, world_size, timeout, use_libuv)
        from rlhf.distributed.stores import bound_store

        return bound_store(hostname, world_size, timeout, port=port, use_libuv=use_libuv)

    create_store.binds_its_host = True  # type: ignore[attr-defined]
    setattr(rendezvous, "_create_c10d_store", create_store)  # noqa: B010 (a module global)
