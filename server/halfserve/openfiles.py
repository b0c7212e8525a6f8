"""The process's open-file limit, which bounds its connections and shared memory regions together: each holds a file
descriptor, and a process out of them drops new connections unanswered (``/health`` and ``/ready`` too)."""

from __future__ import annotations

import logging
import resource

from halfserve.settings import Settings

log = logging.getLogger(__name__)

SPARE = 256
"""Descriptors beside connections and regions: model files, the log, pipes and sockets to instance processes and
front-ends, the event loop's own."""
UNLIMITED_CAP = 1 << 20
"""The soft limit taken where the hard one is unlimited."""


def needed(settings: Settings) -> int:
    """Descriptors the settings may hold open at once: HTTP and gRPC connections, shared memory regions, and
    :data:`SPARE`."""
    connections = settings.max_connections * (2 if settings.grpc else 1)
    return connections + settings.max_shm_regions + SPARE


def raise_limit(settings: Settings) -> int:
    """Raise the soft open-file limit to the hard one, as Go's runtime does at start (a common soft limit of 1024 is
    the default ``max_connections`` alone); warn when it is still below :func:`needed`. Returns the limit in force.
    Inherited by the front-ends and instance processes this process starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = UNLIMITED_CAP if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:  # a container's seccomp profile, or a platform without it
            log.info("open-file limit left at %d: %s", soft, e)
    want = needed(settings)
    if soft != resource.RLIM_INFINITY and soft < want:
        log.warning(
            "the open-file limit (%d, hard %s) is below what the settings may hold open (%d: max_connections for HTTP "
            "and gRPC, max_shm_regions and %d spare): past it new connections are dropped unanswered; raise it "
            "(ulimit -n, or the container's nofile) or lower max_connections",
            soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard,
            want,
            SPARE,
        )
    return int(soft)
