"""The package version, in a module of its own so that library code (the compile cache's key) can read it without
importing the public API module."""

__version__ = "0.1.0"
