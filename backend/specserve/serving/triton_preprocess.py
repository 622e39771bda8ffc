"""The `preprocessing` Triton Python model: contract inputs -> `input_ids` + `request_config`.

It validates the request (`parsing.parse_request`), applies the chat template when asked,
tokenizes with the model's `tokenizer.json` (`tokenizer.PromptTokenizer`) and checks the prompt fits
the context. A bad request gets an INVALID_ARG error naming the field; the ensemble then ends the
client's stream with it.
An unexpected failure answers its own request with INTERNAL: one request never fails the batch.
Not decoupled: one response per request.
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

from specserve.serving.contract import RequestError
from specserve.serving.parameters import (
    model_dir_from_parameters,
    model_parameters,
    request_limits_from_parameters,
)
from specserve.serving.parsing import (
    check_prompt_length,
    encode_request_config,
    parse_request,
)
from specserve.serving.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)


def _error(message: str, code: int) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    def initialize(self, args: dict[str, str]) -> None:
        params = model_parameters(json.loads(args["model_config"]))
        self.limits = request_limits_from_parameters(params)
        self.tokenizer = PromptTokenizer(model_dir_from_parameters(params))

    def execute(self, requests: list[Any]) -> list[Any]:
        return [self._answer(request) for request in requests]

    def _answer(self, request: Any) -> Any:
        """The request's response; an unexpected failure is an INTERNAL error for this request only."""
        try:
            return self._preprocess(request)
        except Exception as e:  # noqa: BLE001 - every request gets its response
            log.error("preprocessing failed:\n%s", traceback.format_exc())
            return _error(f"internal error: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL)

    def _preprocess(self, request: Any) -> Any:
        try:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            parsed = parse_request(inputs, self.limits)
            prompt_ids = self.tokenizer.encode(parsed.text, parsed.apply_chat_template)
            check_prompt_length(prompt_ids, self.limits)
        except RequestError as e:
            return _error(str(e), pb_utils.TritonError.INVALID_ARG)
        return pb_utils.InferenceResponse(
            output_tensors=[
                pb_utils.Tensor("input_ids", np.asarray(prompt_ids, dtype=np.int32)),
                pb_utils.Tensor("request_config", encode_request_config(parsed.request)),
            ]
        )
