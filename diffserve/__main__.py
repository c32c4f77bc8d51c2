import sys

from diffserve.cli import main

sys.exit(main())
