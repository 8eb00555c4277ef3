"""One rank of the transformer-parity check: for each model, the parallel
transformer's output must equal the single-process output in float32.

Usage: transformer_parity.py TRANSPORT SCHEDULE MODEL [MODEL ...]
Exits 0 when every model matches; prints each mismatch and exits 1 otherwise.
"""

import sys

import torch

from cocodiff.runtime.parallel import parallelize
from cocodiff.runtime.probe import transformer_inputs
from cocodiff.runtime.tiny import build_tiny
from transports.registry import create_transport


def check(transport, schedule: str, model: str) -> bool:
    transformer = build_tiny(model).transformer
    inputs = transformer_inputs(model, transformer)
    with torch.no_grad():
        expected = transformer(**inputs, return_dict=False)[0]
        parallelize(transformer, transport, schedule)
        actual = transformer(**inputs, return_dict=False)[0]
    try:
        torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    except AssertionError as error:
        print(f"rank {transport.rank}: {model} {schedule} mismatch: {error}", flush=True)
        return False
    return True


def main() -> int:
    transport_name, schedule, *models = sys.argv[1:]
    transport = create_transport(transport_name)
    try:
        results = [check(transport, schedule, model) for model in models]
    finally:
        transport.close()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
