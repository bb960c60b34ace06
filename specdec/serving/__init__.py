"""Shared gRPC plumbing of the draft and target services: domain messages, server, status."""
