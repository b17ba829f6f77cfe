"""The audit as a library (see :mod:`fedpers.audit.run`)."""
