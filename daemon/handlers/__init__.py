"""Device families. Each module is found through the ``devplugd.handlers`` entry points
(see pyproject.toml); the core imports none of them by name."""
