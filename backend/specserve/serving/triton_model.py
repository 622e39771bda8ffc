"""The decoupled Triton Python model behind every `llm_<variant>` (vLLM-backend style).

auto_complete_config declares the tensors, the decoupled policy and max_batch_size 0, so config.pbtxt
holds only parameters; initialize builds the engine from them and starts its loop thread (on a CPU,
an eager engine that answers at once, replaced by one running the compiled programs once a process
of their own has built them: `engine.precompile`); execute only
parses and submits; the engine thread hands each `RequestOutput` delta to the model's Triton
thread, the one thread that calls into Triton after `execute`: it sends each delta through the
request's response sender, polls the open requests' cancellation and sets the load gauges (so the
engine never waits on Triton's IPC, and once a request is submitted only that thread calls into
the Python backend for it; `execute` itself answers bad input); finalize aborts what is left and
joins both threads.

Every request ends with exactly one FINAL: after its last delta (stream=true), after its single
data response (stream=false: one response with the whole text, then a flag-only FINAL, which is
what HTTP /generate needs), or with an error (INVALID_ARG for bad input, CANCELLED when the client
cancelled, UNAVAILABLE at shutdown, when `max_queue_size` requests already wait, after
`request_timeout_s` or once the engine has stopped, INTERNAL for engine errors). When the engine
loop stops for good (see `loop`), the model unloads itself, so Triton reports it not ready.
The contract is `contract`, parsing `parsing`, parameters `parameters`, metrics `metrics`.
"""

from __future__ import annotations

import collections
import contextlib
import faulthandler
import gc
import json
import locale
import logging
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import triton_python_backend_utils as pb_utils

from specserve.config import EngineConfig, SamplingParams
from specserve.engine.loop import EngineLoop, EngineStopped
from specserve.engine.outputs import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_TIMEOUT,
    EngineLoad,
    QueueFull,
    RequestOutput,
)
from specserve.serving import parameters
from specserve.serving.contract import (
    GenerateRequest,
    RequestError,
    ResponseDelta,
    logprobs_entries,
    output_arrays,
)
from specserve.serving.drain import DrainWatch
from specserve.serving.metrics import RequestStats, ServingMetrics
from specserve.serving.parsing import parse_decoupled_inputs
from specserve.serving.repository import llm_inputs, llm_outputs
from specserve.serving.tokenizer import PromptTokenizer

log = logging.getLogger(__name__)
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


# `InferenceResponseSender.send` of the Python backend shipped with nvidia-pytriton (r24.10) releases
# the GIL, then drops the response's tensors the client did not ask for; the last reference to a
# tensor's numpy array then goes without the GIL, corrupting the interpreter's heap (the stub later
# segfaults in whatever Python another thread runs). Fixed upstream in r24.12 (python_backend #390,
# `~PbTensor` takes the GIL). So a response holds only the outputs its request asked for (nothing is
# dropped), and its tensors stay referenced here after `send`, freed later with the GIL held.
_recently_sent: collections.deque[Any] = collections.deque(maxlen=1024)


def _send(sender: Any, response: Any | None, flags: int = 0, tensors: list[Any] | None = None) -> None:
    sender.send(response, flags=flags)
    _recently_sent.append((response, tensors))


def _tensors(delta: ResponseDelta, wanted: frozenset[str] | None) -> list[Any]:
    """The response's output tensors: those in `wanted` (the request's requested outputs), or all."""
    return [pb_utils.Tensor(name, arr) for name, arr in output_arrays(delta).items()
            if wanted is None or name in wanted]


def _error(message: str, code: int) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class _ResponseStream:
    """One request's responses; `handle` runs on the Triton thread, in delta order."""

    def __init__(self, sender: Any, request: GenerateRequest, metrics: ServingMetrics, closing: threading.Event,
                 decode_token: Callable[[int], str], wanted: frozenset[str] | None = None) -> None:
        self.sender = sender
        self.wanted = wanted  # the outputs the client asked for (None: every output)
        self.decode_token = decode_token
        self.request = request
        self.metrics = metrics
        self.closing = closing
        self.arrival = time.perf_counter()
        self.first_token: float | None = None
        self.text: list[str] = []  # stream=false: accumulated deltas
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, tuple[float, int]]] = []
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.finished = False  # its last output was handled (whether or not its FINAL went out)
        self.final_sent = False

    def handle(self, out: RequestOutput) -> None:
        self.finished = self.finished or out.finished
        if out.token_ids and self.first_token is None:
            self.first_token = time.perf_counter()
        self.metrics.on_delta(
            len(out.token_ids),
            out.num_draft_tokens - self.num_draft_tokens,
            out.num_accepted_tokens - self.num_accepted_tokens,
            out.accept_lengths,
            out.tree_sizes,
        )
        self.num_draft_tokens, self.num_accepted_tokens = out.num_draft_tokens, out.num_accepted_tokens
        if not out.finished:
            if self.request.stream:
                self._send_delta(self._delta(out, out.text, out.token_ids, out.logprobs))
            else:
                self.text.append(out.text)
                self.token_ids.extend(out.token_ids)
                self.logprobs.extend(out.logprobs or [])
            return
        try:
            self._finish(out)
        finally:
            self.metrics.on_finish(
                RequestStats(
                    arrival=self.arrival,
                    first_token=self.first_token,
                    finished=time.perf_counter(),
                    finish_reason=out.finish_reason or FINISH_ERROR,
                    num_prompt_tokens=out.num_prompt_tokens,
                    num_output_tokens=out.num_output_tokens,
                )
            )

    def _finish(self, out: RequestOutput) -> None:
        if out.finish_reason == FINISH_ABORT:
            if self.closing.is_set():
                self._send_final(_error("server shutting down", pb_utils.TritonError.UNAVAILABLE))
            else:
                self._send_final(_error("request cancelled", pb_utils.TritonError.CANCELLED))
        elif out.finish_reason == FINISH_TIMEOUT:
            self._send_final(_error(out.error or "request timed out", pb_utils.TritonError.UNAVAILABLE))
        elif out.finish_reason == FINISH_ERROR:
            self._send_final(_error(out.error or "engine error", pb_utils.TritonError.INTERNAL))
        elif self.request.stream:
            self._send_delta(self._delta(out, out.text, out.token_ids, out.logprobs), flags=FINAL)
        else:  # the one data response /generate needs, then a flag-only FINAL
            text = (self.request.echo_text or "") + "".join(self.text) + out.text
            logprobs = None if out.logprobs is None else self.logprobs + out.logprobs
            self._send_delta(self._delta(out, text, self.token_ids + out.token_ids, logprobs))
            self._send_final(None)

    def _send_final(self, response: Any | None) -> None:
        _send(self.sender, response, flags=FINAL)
        self.final_sent = True

    def _send_delta(self, delta: ResponseDelta, flags: int = 0) -> None:
        tensors = _tensors(delta, self.wanted)
        _send(self.sender, pb_utils.InferenceResponse(output_tensors=tensors), flags=flags, tensors=tensors)
        self.final_sent = self.final_sent or flags == FINAL

    def _delta(self, out: RequestOutput, text: str, token_ids: list[int],
               logprobs: list[dict[int, tuple[float, int]]] | None) -> ResponseDelta:
        return ResponseDelta(
            text=text,
            token_ids=token_ids,
            finish_reason=out.finish_reason,
            num_input_tokens=out.num_prompt_tokens,
            num_output_tokens=len(token_ids),
            num_draft_tokens=out.num_draft_tokens,
            num_accepted_tokens=out.num_accepted_tokens,
            num_verify_steps=out.num_verify_steps,
            logprobs=None if logprobs is None else logprobs_entries(logprobs, self.decode_token),
            cumulative_logprob=out.cumulative_logprob,
            num_cached_tokens=out.num_cached_tokens,
        )

    def abandon(self, message: str) -> None:
        """Last resort after a failure inside `handle`: end the request with an error, unless it ended."""
        if self.final_sent:
            return
        try:
            _send(self.sender, _error(message, pb_utils.TritonError.INTERNAL), flags=FINAL)
        except Exception:  # noqa: BLE001 - the sender may already be closed
            log.error("could not end a request after an error:\n%s", traceback.format_exc())


class _TritonThread:
    """The one thread that calls into Triton once `execute` has handed a request over.

    It sends each request's responses in arrival order, polls the open requests' `is_cancelled`
    (a round trip to the server each) every `poll_interval_s` and hands the cancelled ones to
    `abort`, and sets the load gauges (`set_load`). The engine thread only queues work here. A
    request is polled from `open` until its last output is handled, never after its FINAL.

    """

    def __init__(self, abort: Callable[[str], None], set_load: Callable[[EngineLoad], None],
                 poll_interval_s: float = 0.05) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Any, Any] | None] = queue.SimpleQueue()
        self._open: dict[str, _ResponseStream] = {}  # touched by this thread only
        self._abort, self._set_load, self.poll_interval_s = abort, set_load, poll_interval_s
        self._thread = threading.Thread(target=self._run, name="specserve-triton", daemon=True)
        self._thread.start()

    def open(self, request_id: str, stream: _ResponseStream) -> None:
        """Poll this request's cancellation until its last output."""
        self._queue.put(("open", request_id, stream))

    def put(self, stream: _ResponseStream, out: RequestOutput) -> None:
        self._queue.put(("output", stream, out))

    def load(self, load: EngineLoad) -> None:
        self._queue.put(("load", load, None))

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        next_poll = time.monotonic() + self.poll_interval_s
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                item = ("poll", None, None)
            if item is None:
                return
            try:
                self._do(*item)
            except Exception:  # noqa: BLE001 - one broken response must not stop the others
                log.error("the Triton thread's %s failed:\n%s", item[0], traceback.format_exc())
                if item[0] == "output" and item[2].finished:
                    item[1].abandon("internal error while sending the response")
            if time.monotonic() >= next_poll:
                try:
                    self._poll_cancelled()
                except Exception:  # noqa: BLE001 - polling again next time is all that can be done
                    log.error("polling cancellation failed:\n%s", traceback.format_exc())
                next_poll = time.monotonic() + self.poll_interval_s

    def _do(self, kind: str, a: Any, b: Any) -> None:
        """output: a = the stream, b = its RequestOutput; open: a = the request id, b = its stream;
        load: a = the EngineLoad; poll: nothing (the poll follows every item)."""
        if kind == "output":
            a.handle(b)
        elif kind == "open":
            request_id, stream = a, b
            if not stream.finished:  # its last output may have come first
                self._open[request_id] = stream
        elif kind == "load":
            self._set_load(a)

    def _poll_cancelled(self) -> None:
        for request_id, stream in list(self._open.items()):
            if stream.finished:  # its last output is handled: no more round trips for it
                del self._open[request_id]
                continue
            try:
                cancelled = stream.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - nobody can receive its tokens: end it as cancelled
                log.warning("request %s: asking whether it is cancelled failed; aborting it:\n%s",
                            request_id, traceback.format_exc())
                cancelled = True
            if cancelled:
                del self._open[request_id]
                self._abort(request_id)


def utf8_text_files() -> None:
    """Make UTF-8 the default encoding of text files in this process.

    The python backend's stub embeds an interpreter that starts in the C locale, where `open()`
    reads ASCII; torch's inductor reads its UTF-8 templates that way when it compiles the CPU
    programs. Only the character type category changes (to C.UTF-8), where the C library has it.
    """
    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        with contextlib.suppress(locale.Error):
            locale.setlocale(locale.LC_CTYPE, "C.UTF-8")


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config: Any) -> Any:
        """What config.pbtxt leaves out, as Triton's vLLM backend declares it: the tensors
        (`repository.llm_inputs` / `llm_outputs`), the decoupled policy, no Triton batching."""
        for tensor in llm_inputs():
            auto_complete_model_config.add_input(tensor)
        for tensor in llm_outputs():
            auto_complete_model_config.add_output(tensor)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        auto_complete_model_config.set_max_batch_size(0)
        return auto_complete_model_config

    def initialize(self, args: dict[str, str]) -> None:
        self.compiling = None  # the process building the compiled programs, while it runs
        utf8_text_files()
        faulthandler.enable(all_threads=True)  # a crash in the stub logs every thread's Python stack
        config = json.loads(args["model_config"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException(
                f"{args['model_name']}: must be decoupled: run tritonserver with auto-complete (its default) or "
                "set `model_transaction_policy { decoupled: true }` in config.pbtxt"
            )
        params = parameters.model_parameters(config)
        engine_config = parameters.engine_config_from_parameters(
            params, args.get("model_instance_kind", ""), args.get("model_instance_device_id", ""))
        self.limits = parameters.request_limits_from_parameters(params)
        self.metrics = ServingMetrics(args["model_name"], args["model_version"])
        self.tokenizer = PromptTokenizer(engine_config.model_dir)
        warmup_ids = self.tokenizer.encode("Hello", False)

        # torch and the engine are imported here, not with this module: Triton imports the module
        # once more, in a process of its own, just to ask `auto_complete_config`
        import torch

        from specserve.engine import precompile
        from specserve.engine.engine import Engine

        def build_engine(config: EngineConfig) -> Engine:  # runs on the engine thread (see specserve.engine.loop)
            engine = Engine(config)
            engine.generate([warmup_ids], SamplingParams(max_tokens=2))  # warm-up
            return engine

        self.model_name = args["model_name"]
        self.closing = threading.Event()
        self.triton_thread = _TritonThread(abort=lambda request_id: self.loop.abort(request_id),
                                           set_load=self.metrics.set_load)
        # on CPU: serve at once eagerly; the compiled programs build in a process of their own
        background = precompile.wanted(engine_config)
        if background:  # the eager engine leaves a core to the compiling process; the served one takes it back
            engine_config = precompile.with_threads(engine_config)
        first = precompile.eager_config(engine_config) if background else engine_config
        self.loop = EngineLoop(lambda: build_engine(first), on_step=self.triton_thread.load, on_stopped=self._unload)
        pb_utils.Logger.log_info(
            f"{args['model_name']}: {engine_config.spec.algorithm} on {engine_config.device}, "
            f"{engine_config.max_batch_size} slots x {engine_config.max_seq_len} tokens, "
            f"{engine_config.dtype}, {engine_config.num_threads or torch.get_num_threads()} torch threads"
            + (f" ({first.num_threads} while compiling)" if background else "")
            + (": serving eagerly while its compiled programs build in the background" if background else "")
        )
        self.compiling = precompile.start(engine_config) if background else None
        if self.compiling is not None:
            started = time.monotonic()

            def upgraded() -> Engine:
                engine = precompile.build_served(build_engine, engine_config)
                pb_utils.Logger.log_info(f"{self.model_name}: switched to its compiled programs "
                                         f"{time.monotonic() - started:.0f} s after it began serving")
                return engine

            self.loop.upgrade_when_ready(lambda: precompile.ready(self.compiling, engine_config), upgraded)
        self.drain_watch = DrainWatch.from_environment(self.model_name, self._drain, self.closing)

    def _drain(self, timeout_s: float) -> None:
        """The launcher is stopping the server: new requests are refused, the open ones get
        `timeout_s` to finish, the rest end with UNAVAILABLE "server shutting down" (see `drain`)."""
        pb_utils.Logger.log_info(f"{self.model_name}: shutting down; open requests get {timeout_s:.1f} s to finish")
        self.closing.set()
        aborted = self.loop.drain(timeout_s)
        if aborted:
            pb_utils.Logger.log_info(f"{self.model_name}: {aborted} request(s) ended unfinished at shutdown")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            self._submit(request)
        return None

    def _submit(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            inputs = {t.name(): t.as_numpy() for t in request.inputs()}
            prompt_ids, generate = parse_decoupled_inputs(inputs, self.limits, self.tokenizer)
            stream = _ResponseStream(sender, generate, self.metrics, self.closing, self.tokenizer.decode_token,
                                     frozenset(request.requested_output_names()) or None)
            request_id = self.loop.submit(prompt_ids, generate.params, lambda out: self.triton_thread.put(stream, out))
            self.triton_thread.open(request_id, stream)
        except (RequestError, ValueError) as e:  # the engine raises ValueError naming the field too
            _send(sender, _error(str(e), pb_utils.TritonError.INVALID_ARG), flags=FINAL)
        except (QueueFull, EngineStopped) as e:
            _send(sender, _error(str(e), pb_utils.TritonError.UNAVAILABLE), flags=FINAL)
        except Exception as e:  # noqa: BLE001 - FINAL on every path
            log.error("submit failed:\n%s", traceback.format_exc())
            _send(sender, _error(f"internal error: {type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL),
                  flags=FINAL)

    def _unload(self, reason: str) -> None:
        """The engine loop stopped for good: unload this model (not ready) from a thread of its own,
        as Triton calls `finalize`, which joins the loop thread this runs on."""
        pb_utils.Logger.log_error(f"{self.model_name}: {reason}; unloading the model")

        def unload() -> None:
            try:
                pb_utils.unload_model(self.model_name)
            except Exception:  # noqa: BLE001 - a server without explicit model control keeps it loaded
                log.error("could not unload %s:\n%s", self.model_name, traceback.format_exc())

        threading.Thread(target=unload, name="specserve-unload", daemon=True).start()

    def finalize(self) -> None:
        """End what is left (UNAVAILABLE), join both threads, then drop everything that refers to the
        server (responses kept after `send`, metrics) while the stub still runs: nothing of this model
        is left for the interpreter's last garbage collection."""
        self.closing.set()
        if self.compiling is not None and self.compiling.poll() is None:
            self.compiling.kill()
            self.compiling.wait()
        self.loop.shutdown()  # aborts what is left; their FINALs go through the Triton thread
        self.drain_watch.join()
        self.triton_thread.close()
        _recently_sent.clear()
        self.metrics.close()
        vars(self).clear()  # the loop's callbacks and the upgrade's closure refer back to this model
        gc.collect()
