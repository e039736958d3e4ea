"""Patching: apply a plan to one model instance, all-or-nothing, and revert it; the installed forwards
(picklable) and where they go beneath library wrappers. Knows nothing of verification."""
