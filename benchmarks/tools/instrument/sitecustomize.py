"""Probe instrumentation, loaded by putting this folder first on PYTHONPATH (every process then imports it).

From the repository root: ``PYTHONPATH=benchmarks/tools/instrument:benchmarks:. ... python benchmarks/tools/probe.py``
(``.`` so that this tree's ``server`` is the one patched: site-customisation runs before a script's own folder, or
``-m``'s working directory, is on ``sys.path``).

Env: ``SWI`` sets ``sys.setswitchinterval``; ``PROF_OUT`` (a folder) times each instance's upload, graph replay,
fetch (the device wait included) and whole batch on its thread, summed, written every 200 batches of instance 0 as
``prof-<pid>.json``; ``NOPIN`` keeps the engine process from page-locking the front-ends' shared memory.
"""

import os
import sys

if os.environ.get("SWI"):
    sys.setswitchinterval(float(os.environ["SWI"]))

if os.environ.get("PROF_OUT"):
    import json
    import threading
    import time

    import halfserve.engine.core as eng
    import halfserve.instance as ins

    lock = threading.Lock()
    stats: dict = {}
    orig_stage, orig_replay, orig_fetch = ins.Instance.stage, ins.Instance.replay, ins.Instance.fetch
    orig_fc = eng.Engine.forward

    def add(inst, key, dt):
        with lock:
            d = stats.setdefault(inst.index, {})
            d[key] = d.get(key, 0.0) + dt

    orig_upload = ins.Instance.upload

    def stage(self, chunks, size):
        t = time.perf_counter()
        try:
            return orig_stage(self, chunks, size)
        finally:
            add(self, "stage", time.perf_counter() - t)

    def upload(self, chunks, size, into=None):
        t = time.perf_counter()
        try:
            return orig_upload(self, chunks, size, into)
        finally:
            add(self, "upload", time.perf_counter() - t)

    def replay(self, graph, chunks, size):
        t = time.perf_counter()
        try:
            return orig_replay(self, graph, chunks, size)
        finally:
            add(self, "replay_incl_upload", time.perf_counter() - t)

    def fetch(self, y):
        t = time.perf_counter()
        try:
            return orig_fetch(self, y)
        finally:
            add(self, "fetch_sync", time.perf_counter() - t)

    last_end: dict = {}

    def forward(self, chunks, inst=None):
        chunks = chunks if isinstance(chunks, list) else [chunks]
        inst = inst or self.instances[0]
        t = time.perf_counter()
        if inst.index in last_end:
            add(inst, "idle", t - last_end[inst.index])
        try:
            return orig_fc(self, chunks, inst)
        finally:
            end = time.perf_counter()
            last_end[inst.index] = end
            add(inst, "forward_chunks", end - t)
            add(inst, "rows", sum(len(c) for c in chunks))
            add(inst, "batches", 1)
            if inst.index == 0 and int(stats[0]["batches"]) % 200 == 0:
                path = os.path.join(os.environ["PROF_OUT"], f"prof-{os.getpid()}.json")
                with lock:
                    snap = json.dumps(stats)
                with open(path, "w") as f:
                    f.write(snap)

    ins.Instance.stage, ins.Instance.replay, ins.Instance.fetch = stage, replay, fetch
    ins.Instance.upload = upload
    eng.Engine.forward = forward

if os.environ.get("NOPIN"):
    import halfserve.multiproc.engine_side as bp

    bp.pin_host = lambda memory: None
