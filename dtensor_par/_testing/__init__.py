"""What the tests and the benchmarks share: small models written as users write them
(``models``, ``recurrences``), real models built from small configs (``real_models``: the
``models`` extra), gloo launches and comparison against one device (``harness``).

Part of the package so that the benchmarks import no test module; no module of ``dtensor_par``
imports it, and it imports no pytest (``tests/`` keeps the fixtures and the background
launches). Functions the ranks run live in importable modules: a rank unpickles them by path."""
