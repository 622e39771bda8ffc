"""Triton entry point of a decoupled llm_<variant> model: see specserve.serving.triton_model."""

from specserve.serving.triton_model import TritonPythonModel  # noqa: F401
