"""The draft service; `python -m draft_service` runs it alone."""

import specdec  # noqa: F401  (first: turns gRPC's fork handlers off before grpc loads)
