"""Triton entry point of `preprocessing`: see specserve.triton_preprocess."""

from specserve.triton_preprocess import TritonPythonModel  # noqa: F401
