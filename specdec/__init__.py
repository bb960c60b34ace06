"""Shared code of the specdec services: sampling parameters, counter-based random streams,
the model runner and the generated protobuf modules."""

__version__ = "0.1.0"
