import sys

from halfserve.cli import main

if __name__ == "__main__":  # not when a front-end process, spawned by multiprocessing, imports this module
    sys.exit(main())
