"""Testing support: the multi-process harness, exact test data and the reference
implementation of every collective (the oracle of plait's own tests, usable by yours).

- :mod:`plait.testing.harness`: pools of real rank processes that run test cases.
- :mod:`plait.testing.data`: exact, seeded data that depends on rank and index.
- :mod:`plait.testing.reference`: every collective over lists of per-rank arrays.
"""
