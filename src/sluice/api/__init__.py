"""The HTTP layer: wire formats in and out. The only package that imports the web framework."""

from sluice.api.app import ApiConfig, build_app

__all__ = ["ApiConfig", "build_app"]
