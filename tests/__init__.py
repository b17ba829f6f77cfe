"""fedpers tests (a package, so an installed third-party `tests` package cannot shadow it)."""
