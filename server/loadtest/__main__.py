import sys

from server.loadtest.cli import main

sys.exit(main())
