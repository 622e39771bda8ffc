"""Triton entry point of a decoupled specdec model: see specserve.triton_model."""

from specserve.triton_model import TritonPythonModel  # noqa: F401
