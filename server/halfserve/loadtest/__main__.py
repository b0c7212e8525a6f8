import sys

from halfserve.loadtest.cli import main

sys.exit(main())
