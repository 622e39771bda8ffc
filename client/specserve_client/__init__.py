"""Clients for specserve's Triton model repository: streaming library, CLI, load tests, benchmarks."""

from specserve_client.stream import (
    Delta,
    GenerateError,
    Generation,
    collect,
    grpc_stream,
    http_generate,
    http_generate_stream,
    stream,
)

__all__ = [
    "Delta",
    "GenerateError",
    "Generation",
    "collect",
    "grpc_stream",
    "http_generate",
    "http_generate_stream",
    "stream",
]
