"""Tools around the core, not needed to serve: real selection traces (``traces``: format,
recording with SmolLM2 in ``smollm``, locality statistics), residency simulations that drive
the real selection-group code (``residency``), replay of traces through the core (``replay``)
and the ``ulacache`` command line (``cli``). Needs numpy (the ``[trace]`` extra)."""
