import sys

from fedpers.commands.cli import main

sys.exit(main())
