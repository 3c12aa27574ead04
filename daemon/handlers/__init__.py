"""Device families. Each package is found through the ``devplugd.handlers`` entry points (see
pyproject.toml); the core imports none of them by name. The ``_*.py`` modules beside the packages
hold what several handlers share (``_functions``, ``_linktypes``, ``_sriov_allocation``,
``_sriov_selectors``: pci and auxnet; ``_devnodes``: devnode and usb): a handler package imports
the core, its own modules and these, never another handler package."""
