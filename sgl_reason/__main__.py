import sys

from sgl_reason.cli import main

sys.exit(main())
