"""The runtime: real diffusers pipelines executed under Ulysses sequence parallelism.

``parallel`` parallelises an unmodified model (installing ``hooks``; the plan's steps
run through ``backend``, TAPA's phases through ``tapa``, V-Major's selection through
``vmajor``; Ring and batch layouts in ``hybrid``); ``families`` holds what differs per
model family; ``job`` is one ``cocodiff run`` on every rank, ``failures`` how a rank
fails without hanging the others; ``doctor`` checks a launch; ``tiny``, ``digits`` and
``pipelines`` build and run the models.
"""
