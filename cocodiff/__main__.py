"""`python -m cocodiff` (as torchrun needs)."""

import sys

from cocodiff.commands.cli import main
from transports.launch import detect_launch, exit_rank

code = main()
try:
    launched = detect_launch().world_size > 1
except ValueError:  # malformed launcher variables: main() has said so
    launched = False
if launched:
    exit_rank(code)  # a rank of a job: skip the teardown, paid once per rank on shared cores
sys.exit(code)
