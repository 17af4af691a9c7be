"""``python -m trainmover.agent``: the job's store host and process supervisor."""
import sys

from trainmover.agent.main import main

sys.exit(main())
