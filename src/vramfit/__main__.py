import sys

from vramfit.cli import main

sys.exit(main())
