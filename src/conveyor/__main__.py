"""`python -m conveyor ...` is the `conveyor` command, where only the interpreter's path is known (sbatch scripts)."""

import sys

from conveyor.cli.main import main

sys.exit(main())
