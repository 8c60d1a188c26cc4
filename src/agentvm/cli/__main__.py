import sys

from agentvm.cli import main

sys.exit(main())
