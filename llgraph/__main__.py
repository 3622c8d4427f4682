import sys

from llgraph.runtime.cli import main

if __name__ == "__main__":  # not when a worker process (multiprocessing's spawn) imports the main module
    sys.exit(main())
