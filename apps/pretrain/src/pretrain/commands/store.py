"""`pretrain store --port P`: the job's rendezvous store, in a process no training node hosts.

Every launcher (``pretrain train --external-store --rdzv-endpoint HOST:P``) or torchrun worker of a fault-tolerant
run (``--rdzv-endpoint HOST:P``) connects to it as a client, so the death of any node, the first one's too, leaves
the store and the other nodes' run going. It holds the store until a SIGTERM, SIGINT or SIGHUP, then exits 0.
"""

from __future__ import annotations

import signal
import threading

import typer

from ..errors import UsageError, fail


def store(
    port: int = typer.Option(..., "--port", help="Port to listen on (1..65535); the nodes' --rdzv-endpoint HOST:PORT."),
    host: str = typer.Option("0.0.0.0", "--host", help="Address to listen on (default: every interface)."),
) -> None:
    """Run the job's rendezvous store until stopped (a signal): every node of the run connects to it."""
    from ..runtime.node_group import serve_store
    from ..runtime.rank_env import STOP_SIGNALS

    try:
        if not 0 < port < 65536:
            raise UsageError(f"--port {port} must be in 1..65535")
        server = serve_store(host, port, 300.0, f"--host {host} --port {port}:")
    except UsageError as e:
        raise fail(str(e))
    stopped = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stopped.set()) for s in STOP_SIGNALS}
    typer.echo(f"pretrain store: listening on {host}:{port}", err=True)
    try:
        while not stopped.wait(1.0):
            pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        del server
