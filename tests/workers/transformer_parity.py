"""Temporary alias of parity.py (argument order: TRANSPORT MODEL [SCHEDULE]) kept while the
model families are added; parity.py is the worker the tests use."""

import sys

from parity import main

if __name__ == "__main__":
    transport_name, model, *rest = sys.argv[1:]
    sys.argv = [sys.argv[0], transport_name, rest[0] if rest else "flat", model]
    sys.exit(main())
