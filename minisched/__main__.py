import sys

from minisched.cli import main

sys.exit(main())
