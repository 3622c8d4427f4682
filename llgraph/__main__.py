import sys

from llgraph.cli import main

sys.exit(main())
