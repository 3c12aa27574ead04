"""What keeps pools of a loaded config from working on this host, said when it is loaded.

An optional handler hint, looked up by name as ``fold_may_block`` and ``health_step`` are:
``host_problems(pools)`` returns one message per problem it finds for its share of the pools
(the pci handler's: ``vfioOnDemand`` pools whose sysfs is read-only for the daemon). Each is
logged as an error once when the daemon starts and once at each reload (``daemon.app``), so a
config that cannot work as written says so when it is applied, not at the first claim.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from daemon.core._config import DaemonConfig
from daemon.core._handler import AnyHandler

log = logging.getLogger("devplugd")


def log_host_problems(handlers: Mapping[str, AnyHandler], config: DaemonConfig) -> DaemonConfig:
    """Log, as errors, what each handler's ``host_problems`` finds for its pools of ``config``;
    ``config`` itself, for a reload to pass on."""
    for name, handler in handlers.items():
        problems = getattr(handler, "host_problems", None)
        pools = [pool for pool in config.pools if pool.handler == name]
        if problems is None or not pools:
            continue
        try:
            found = problems(pools)
        except Exception:  # a check that fails must not keep the config from being served
            log.exception("handler %s failed to check the host for its pools", name)
            continue
        for problem in found:
            log.error("config %s: %s", config.source, problem)
    return config
