"""Triton entry point of a decoupled specdec model: see specserve.serving.triton_model."""

from specserve.serving.triton_model import TritonPythonModel  # noqa: F401
