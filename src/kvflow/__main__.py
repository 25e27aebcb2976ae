import sys

from kvflow.cli.main import main

sys.exit(main())
