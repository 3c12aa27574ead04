"""devplugd: a Kubernetes device plugin daemon that reacts to kernel events."""

__version__ = "0.1.0"
