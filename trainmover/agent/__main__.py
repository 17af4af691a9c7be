"""``python -m trainmover.agent``: the job's store host and process supervisor."""
from trainmover.agent.main import main
from trainmover.core.proc import exit_now

code = main()       # an exception leaves the usual way, with its traceback
# Everything the agent leaves behind is written by then: events are unbuffered appends, its
# workers have exited, and the controller has read "done" and acknowledged it.
exit_now(code)
