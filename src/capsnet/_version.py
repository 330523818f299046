"""The package version, in a foundation module so that any layer can read it without importing the public API."""

__version__ = "0.1.0"
