"""torchrun plugin: `[project.entry-points."torchrun.handlers"] etcd3 = ...:create_handler`.

torch's registry calls the entry point with no arguments *while importing*
`torch.distributed.elastic.rendezvous`, and registers what it returns as the handler factory.
So this module imports nothing from torch or from `rendezvous` at import time (that would be a
circular import); the factory imports `rendezvous` on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def _create_etcd3_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    from elasticyolo.engines.torch.rendezvous import create_handler as create

    return create(params)


def create_handler() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """Entry point: returns the factory torch registers under the name `etcd3`."""
    return _create_etcd3_handler
