"""``python -m trainmover.worker``: one worker or standby process of a job."""
import os
import sys

from trainmover.worker.main import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown: after an aborted step, gloo threads of abandoned groups stay
# blocked until their timeout and their destructors would hold the exit that long.
# Everything this process must leave behind (events, metrics, shards) is already written.
os._exit(code)
