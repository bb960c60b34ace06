"""The target service; `python -m target_service` runs it alone."""

import specdec  # noqa: F401  (first: turns gRPC's fork handlers off before grpc loads)
