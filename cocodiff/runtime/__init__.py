"""The runtime: real diffusers pipelines executed under Ulysses sequence parallelism."""
