"""Placement rules, one module per op family, and the registry that finds them.

A rule sees the placements its tensor inputs arrive with and returns a ``NodeSharding``:
the placement each input must have (localize inserts the collective where it differs) and
the placement of the output. Ops without a rule, or whose sharded dim the rule cannot keep,
get their inputs gathered (Replicate), with a warning naming the node: never a guess.

Importing the package registers every family.
"""

from . import attention, indexing, matmul, pointwise, reductions, routing, views  # noqa: F401  (they register)
