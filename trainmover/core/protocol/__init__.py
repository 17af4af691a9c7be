"""The store keys and messages shared by the coordinator and the workers. Pure (no torch):
everything that crosses a process boundary is named here, once.

Commands are JSON objects sent to a host's processes as one message a controller round
(``agent/<node>/cmd/<n>``, numbered by the controller, so a resumed controller re-sending
one writes the same key twice, never two messages); the host's agent waits on the next
index and relays each command on its process's channel, where the process's reader thread
queues it, so checking for a command costs the training loop one ``queue.Queue`` look-up per
step.

One namespace (``from trainmover.core import protocol as P``), four parts: ``keys`` (the
store's keys), ``codec`` (messages as checked JSON), ``messages`` (the dataclasses),
``channel`` (a process's datagrams to its agent).
"""
from trainmover.core.protocol.keys import *  # noqa: F401,F403
from trainmover.core.protocol.codec import *  # noqa: F401,F403
from trainmover.core.protocol.codec import _checker, _make_checker  # noqa: F401
from trainmover.core.protocol.messages import *  # noqa: F401,F403
from trainmover.core.protocol.channel import *  # noqa: F401,F403
