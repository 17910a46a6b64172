"""``python -m course_lib.train_ddp [options]``: the recipe's command line (``cli.main``)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
