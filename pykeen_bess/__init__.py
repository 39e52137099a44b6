"""pykeen-bess: BESS training and sharded evaluation for PyKEEN."""

__version__ = "0.1.0"
