"""devplugd's tests.

Where things live:

* ``test_*.py``: the tests, one module per behaviour; a test module never imports from another
  test module.
* ``conftest.py``: every fixture used by more than one test module, defined once (a fixture
  used by one module only stays in that module).
* The other modules here (``fakesysfs``, ``kubelet``, ``pci``, ...) and the packages ``e2e`` and
  ``guest``: support modules, the helpers that more than one test module uses. They hold no
  tests and no fixtures.
"""
