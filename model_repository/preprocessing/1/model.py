"""Triton entry point of `preprocessing`: see specserve.serving.triton_preprocess."""

from specserve.serving.triton_preprocess import TritonPythonModel  # noqa: F401
