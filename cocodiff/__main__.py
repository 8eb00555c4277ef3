"""`python -m cocodiff` (as torchrun needs)."""

import sys

from cocodiff.commands.cli import main

sys.exit(main())
