"""`python -m cocodiff` (as torchrun needs)."""

import sys

from cocodiff.cli import main

sys.exit(main())
