import sys

from trainmover.cli import main

sys.exit(main())
