"""The package's version, on the lowest floor so that every layer can record it without
importing the package's front door (``hf_pma/__init__.py`` re-exports it as ``hf_pma.__version__``;
``pyproject.toml`` reads it from here)."""

__version__ = "0.2.0.dev0"  # the top heading of CHANGELOG.md; tests/test_package.py checks it
