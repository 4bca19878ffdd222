import sys

from tgserve.cli import main

sys.exit(main())
