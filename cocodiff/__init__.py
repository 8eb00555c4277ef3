"""CoCoDiff: topology-aware Ulysses sequence parallelism for Diffusion Transformers."""
