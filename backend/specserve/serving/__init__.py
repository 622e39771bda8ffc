"""Serving under Triton: the Python models, the request contract, parameters, metrics, the repository's configs,
the server launcher."""
