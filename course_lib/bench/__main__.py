"""``python -m course_lib.bench NAME``: run one of the course's benchmarks."""
import sys

from . import main

sys.exit(main())
