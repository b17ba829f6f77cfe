import sys

from fedpers.cli import main

sys.exit(main())
