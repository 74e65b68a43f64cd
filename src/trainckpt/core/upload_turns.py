"""`throttle_uploads`: the ranks of one node upload to an object store one at a time.

The rule: ranks are grouped by node (host name). Within a node, ranks take turns in ascending
global-rank order — the node's first rank uploads in turn 0, its second in turn 1, and so on.
Every turn ends with a barrier on the checkpointer's process group, so at any moment at most one
rank per node is uploading, while the nodes upload in parallel. The number of turns is the
largest number of ranks on one node; a rank with nothing to do in a turn just waits at the
barrier. A whole turn must fit within `collective_timeout` (the barrier's timeout).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from trainckpt.core import dist


def node_turn(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(this rank's turn, number of turns) under the rule above.

    Called on: all ranks of `group`.
    """
    hosts = dist.all_gather_object(socket.gethostname(), group)
    me = dist.get_rank(group)
    turn = sum(1 for rank in range(me) if hosts[rank] == hosts[me])
    turns = max(hosts.count(h) for h in set(hosts))
    return turn, turns


def run_in_turns(upload: Callable[[], None], group: dist.ProcessGroup | None) -> None:
    """Run `upload` in this rank's turn under the rule above.

    An upload error is held until every turn has passed (so every rank joins every barrier)
    and then raised; the commit protocol then shares it with the other ranks.
    Called on: all ranks of `group`.
    """
    turn, turns = node_turn(group)
    error: Exception | None = None
    for current in range(turns):
        if current == turn:
            try:
                upload()
            except Exception as e:  # raised after the last turn, below
                error = e
        # End of a turn: without this barrier, the node's next rank would start uploading
        # while this turn's rank is still sending, and the node's uploads would overlap.
        dist.barrier(group)
    if error is not None:
        raise error
