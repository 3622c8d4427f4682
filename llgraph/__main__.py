import sys

from llgraph.runtime.cli import main

sys.exit(main())
