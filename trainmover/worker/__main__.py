"""``python -m trainmover.worker``: one worker or standby process of a job."""
from trainmover.core.proc import exit_now
from trainmover.worker.main import main

code = main()
# No interpreter teardown: after an aborted step, gloo threads of abandoned groups stay
# blocked until their timeout and their destructors would hold the exit that long.
# Everything this process must leave behind (events, metrics, shards) is already written.
exit_now(code)
