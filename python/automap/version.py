"""The package version, one place for the plan records and the CLI."""

__version__ = "0.1.0"
