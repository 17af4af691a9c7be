"""``python -m trainmover.agent``: the job's store host and process supervisor."""
import os
import sys

from trainmover.agent.main import main

code = main()       # an exception leaves the usual way, with its traceback
sys.stdout.flush()
sys.stderr.flush()
# Skip interpreter teardown: freeing the modules of torch and torch._dynamo took 0.5-1 s of
# CPU (seconds on a loaded host) after every job, which the controller waits for. Everything
# the agent leaves behind is written by then: events are unbuffered appends, its workers
# have exited, and the controller has read "done" and acknowledged it.
os._exit(code)
