"""The optional C accelerators; everything else about the package is in pyproject.toml.

Both extensions are optional: without a compiler the install still succeeds and kvevents runs
its pure-Python code instead (kvevents.blocktable and kvevents._zmq_direct pick at import).
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        # The prefix index's tables and hot loops (kvevents.blocktable; reference: _blocktable_py).
        Extension("kvevents._blocktable", ["src/kvevents/_blocktable.c"], optional=True),
        # One-call receive of a whole ZeroMQ message for the subscriber.
        Extension("kvevents._zmqrecv", ["src/kvevents/_zmqrecv.c"], optional=True),
    ]
)
