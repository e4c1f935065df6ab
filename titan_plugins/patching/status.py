"""Patch statuses: the one set of names for what the engine did with a patch record.

The engine is the only writer of a patch's status; reports, the CLI and doctor read these names.
(A *plugin's* load state - enabled / disabled / failed - is a different thing, kept by the
manager.)
"""

from __future__ import annotations

PENDING = "pending"  # registered; its module has not executed yet (or it was undone)
APPLIED = "applied"  # the target holds the patched value
SKIPPED = "skipped"  # deliberately not applied: version gate, signature, optional target absent
FAILED = "failed"  # should have applied but could not (factory raised, target absent, conflict)
# By design: a variant written for another supported Megatron line (its target moved or changed
# there); the variant for the imported line is its own record. Not a skip, not a STRICT problem.
OTHER_LINE = "other line"

STATUSES = (PENDING, APPLIED, SKIPPED, FAILED, OTHER_LINE)
