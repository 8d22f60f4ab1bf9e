"""The optional C accelerators; everything else about the package is in pyproject.toml.

Each of the four extensions is optional: without a compiler the install still succeeds and
kvevents runs its pure-Python code instead (kvevents.index.table, kvevents.subscribe._recv,
kvevents.publish.send and kvevents.http._scan pick at import).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # The prefix index's tables and hot loops (kvevents.index.table; reference: _table_py).
        Extension(
            "kvevents.index._blocktable", ["src/kvevents/index/_blocktable.c"], optional=True
        ),
        # One-call receive of a whole ZeroMQ message for the subscriber.
        Extension(
            "kvevents.subscribe._zmqrecv", ["src/kvevents/subscribe/_zmqrecv.c"], optional=True
        ),
        # The publisher's send, a large payload lent to libzmq instead of copied.
        Extension(
            "kvevents.publish._zerosend", ["src/kvevents/publish/_zerosend.c"], optional=True
        ),
        # The JSON scanners of HTTP bodies: a query's token ids packed from the JSON text in
        # one pass (kvevents.http._scan; reference: _scan_py).
        Extension("kvevents.http._jsonscan", ["src/kvevents/http/_jsonscan.c"], optional=True),
    ]
)
