"""Is the run folder's job daemon serving? (a socket file alone may be a dead daemon's)"""
from __future__ import annotations

import os

from orchestrator.engine.runfolder import RunFolder


def daemon_answers(rf: RunFolder) -> bool:
    """HELLO to the job daemon: READY means it serves (a socket file alone may be a dead daemon's)."""
    import zmq
    from protocol.messages import Hello, Ready
    from protocol.sockets import LazyPirate
    from protocol.version import VERSION
    ctx = zmq.Context()
    try:
        with LazyPirate(ctx, rf.daemon_endpoint, peer="orchestrator daemon", timeout_s=2.0, retries=0) as link:
            return isinstance(link.request(Hello(peer="demo", pid=os.getpid(), version=VERSION)), Ready)
    except Exception:  # noqa: BLE001 - not up yet
        return False
    finally:
        ctx.term()
