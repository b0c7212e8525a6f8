"""The server's transports and the data plane they share: it loads nothing itself, so that a part imported alone
loads only what it needs.

* :mod:`halfserve.api.dataplane`: a request decoded, submitted and encoded, whichever transport carried it;
* :mod:`halfserve.api.http`: the HTTP routes (``/predict``, KServe V2, health, metrics, management);
* :mod:`halfserve.api.grpc`: KServe V2 over gRPC;
* what both transports share: the errors they answer (:mod:`halfserve.api.errors`), the admin token, readiness and
  versions (:mod:`halfserve.api.access`, :mod:`halfserve.api.lockout`), the repository's management
  (:mod:`halfserve.api.admin`).
"""
