"""``ReasonBackend``: SGLang's ``RuntimeEndpoint`` that records what every request cost.

Programs run on :meth:`ReasonBackend.scoped` copies: each copy shares the connection settings
and owns a fresh :class:`CostRecorder`, so concurrent program calls keep separate ledgers. Every
``/generate`` request the frontend sends goes through :meth:`_post_generate` (gen, select, the
prefix commit before a fork), so the ledger counts all of them.

Request extras: SGLang's ``gen`` has no way to pass a custom logit processor. A program calls
:func:`set_request_extras` right before a ``gen``; the next request of that state carries them.

Token-exact continuation: SGLang's frontend sends a state's whole text with every request, and the
server re-tokenizes it, so a trace generated in pieces (chunked thinking, a probe, the answer)
would not continue the model's own tokens: at each seam the text can tokenize differently
(``"12" + "3"`` becomes ``"123"``), which changes what the model sees and leaves the seam's KV
uncached. Here each state remembers the token ids of its last request (prompt + completion,
when the completion ended on its length, so text and ids agree) and the next request sends
those ids plus only the new text, tokenized; forks inherit them. A piecewise trace is then
the same token sequence as one request, and a continuation prefills exactly one token.
"""

from __future__ import annotations

import copy
import functools
import http.client
import json
import logging
import threading
import time
import urllib.error
import uuid
import warnings

import requests

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
from sglang.lang.chat_template import register_chat_template_matching_function
from sglang.lang.global_config import global_config
from sglang.lang.interpreter import ProgramState, StreamExecutor
from sglang.lang.ir import SglSamplingParams
from sglang.utils import http_request

from sgl_reason import tracking
from sgl_reason.cost import CostRecorder

logger = logging.getLogger(__name__)


@register_chat_template_matching_function
def _match_reasoner(model_path: str) -> str | None:
    """sgl-reason's tiny reasoner was trained on ChatML prompts (``reasoner/train.py``)."""
    return "chatml" if "sgl-reason-reasoner" in model_path.lower() else None

_EXTRAS_VAR = "__sgl_reason_request_extras__"
# Extras that SGLang expects inside sampling_params rather than at the top of the request.
_SAMPLING_EXTRAS = frozenset({"custom_params"})
# The server returns output ids beside meta_info; programs find them here.
OUTPUT_IDS_KEY = "output_ids"
# (text, token ids) of a state's last request, prompt and completion; forks copy variables.
_IDS_VAR = "__sgl_reason_token_ids__"


def sync(s: ProgramState) -> None:
    """``s.sync()``, raising the state's executor error instead of waiting forever: once a
    request of ``s`` failed (a server gone, a cancelled program), SGLang's executor thread has
    exited and a later sync would wait on it for good."""
    ex = s.stream_executor
    if ex.error_ is not None:
        raise ex.error_
    s.sync()
    if ex.error_ is not None:
        raise ex.error_


def set_request_extras(s: ProgramState, **extras) -> None:
    """Attach top-level ``/generate`` fields (e.g. ``custom_logit_processor``) to the next ``gen``
    of ``s``. Syncs first, so that no queued request of ``s`` picks them up by mistake."""
    sync(s)
    s.set_var(_EXTRAS_VAR, extras)


class ServerUnreachable(ConnectionError):
    """No SGLang server answers at the URL (or it stopped answering mid-request); the message
    says what to do."""


def _unreachable(url: str, error: Exception) -> ServerUnreachable:
    return ServerUnreachable(
        f"the SGLang server at {url} stopped answering mid-request ({error}). Its requests "
        "are lost; restart the server (and rerun: `sgl-reason eval` resumes where it stopped).")


# What urllib raises when the server's process is gone (refused, reset, closed mid-reply).
_CONNECTION_ERRORS = (urllib.error.URLError, ConnectionError, http.client.HTTPException)


class ProgramCancelled(RuntimeError):
    """The program's :class:`CancelScope` was cancelled (its client left, or it timed out)."""


def quiet_cancelled_programs() -> None:
    """Silence the traceback SGLang's executor thread warns with when a ``gen`` raises
    :class:`ProgramCancelled`: a client leaving is routine, and the caller still gets the
    exception. Installed on import; other errors keep their warning."""
    warnings.filterwarnings("ignore", category=UserWarning,
                            message=r"(?s)Error in stream_executor: .*ProgramCancelled")


quiet_cancelled_programs()


class CancelScope:
    """The server requests of one program call, so that they can be aborted together.

    A backend with a scope (:meth:`ReasonBackend.cancellable`) gives every request it sends a
    request id and remembers it while it runs; :meth:`cancel` aborts the running ones on the
    server (``/abort_request``: their KV is freed) and makes every later request of the call
    raise :class:`ProgramCancelled` instead of being sent."""

    def __init__(self, base_url: str, api_key: str | None = None):
        self.base_url, self.api_key = base_url, api_key
        self._lock = threading.Lock()
        self._live: set[str] = set()
        self.cancelled = False

    def start(self, data: dict) -> str:
        with self._lock:
            if self.cancelled:
                raise ProgramCancelled("the program was cancelled; no new request is sent")
            rid = data.setdefault("rid", uuid.uuid4().hex)
            self._live.add(rid)
            return rid

    def end(self, rid: str) -> None:
        with self._lock:
            self._live.discard(rid)

    def cancel(self) -> int:
        """Abort every running request of the call; returns how many were aborted."""
        with self._lock:
            self.cancelled = True
            live = sorted(self._live)
        for rid in live:
            try:
                http_request(self.base_url + "/abort_request", json={"rid": rid},
                             api_key=self.api_key)
            except Exception as error:  # noqa: BLE001  (a server already gone: nothing to free)
                logger.warning("could not abort request %s: %s", rid, error)
        return len(live)


def _lines(res, url: str):
    """A streamed response's lines; a server that dies mid-stream is ServerUnreachable."""
    try:
        yield from res.iter_lines(decode_unicode=False)
    except (*_CONNECTION_ERRORS, requests.RequestException) as error:
        raise _unreachable(url, error) from error


class ReasonBackend(RuntimeEndpoint):
    def __init__(self, base_url: str, api_key: str | None = None):
        super().__init__(base_url, api_key=api_key)
        self.recorder = CostRecorder()
        self.cancel_scope: CancelScope | None = None
        self._fixed_ids: dict[str, list[int]] = {}  # shared by scoped copies
        self._server_info: dict = {}  # likewise: asked of the server once per backend

    def scoped(self) -> "ReasonBackend":
        """A copy with its own cost ledger (no new connection, no server round trip)."""
        clone = copy.copy(self)
        clone.recorder = CostRecorder()
        return clone

    def cancellable(self) -> tuple["ReasonBackend", CancelScope]:
        """A scoped copy whose requests can be aborted together, and the scope that does it.
        Programs run on it scope their own copies, which keep the scope."""
        clone = self.scoped()
        clone.cancel_scope = CancelScope(self.base_url, self.api_key)
        return clone, clone.cancel_scope

    def flush_cache(self, wait: float = 120.0) -> None:
        """Empty the server's radix cache. SGLang refuses while any request is in its batch, and
        a request whose reply has arrived can still be in it for a step (an aborted one for
        longer): a notebook's flush right after a program failed that way. So this retries
        until the server is idle, for up to ``wait`` seconds (30 s once ran out in the full
        suite while a second server started beside this one on the 2 CPU cores). Any refusal
        but SGLang's busy 400 raises at once."""
        deadline = time.monotonic() + wait
        while True:
            try:
                res = http_request(self.base_url + "/flush_cache", api_key=self.api_key,
                                   method="POST")
            except _CONNECTION_ERRORS as error:
                raise _unreachable(self.base_url, error) from error
            if res.status_code == 200:
                return
            if res.status_code != 400:  # not SGLang's "busy": a wrong API key, a proxy's error
                self._assert_success(res)
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the server at {self.base_url} kept refusing to flush its cache for "
                    f"{wait:.0f} s ({res.text.strip()}): a request "
                    "is still running there; wait for it or abort it, then flush again.")
            time.sleep(0.2)

    # -- server facts, asked once per backend ---------------------------------------------------
    @property
    def server_info(self) -> dict:
        if not self._server_info:
            try:
                res = http_request(self.base_url + "/get_server_info", api_key=self.api_key)
            except _CONNECTION_ERRORS as error:  # first asked mid-run, by a program
                raise _unreachable(self.base_url, error) from error
            self._assert_success(res)
            self._server_info.update(res.json())
        return self._server_info

    @property
    def supports_logit_processor(self) -> bool:
        return bool(self.server_info.get("enable_custom_logit_processor"))

    @property
    def thinking_kv(self) -> bool:
        """Whether the server runs sgl-reason's thinking-KV cache (per-request KV policies)."""
        return self.server_info.get("radix_cache_backend") == "sgl-reason"

    def tokenize(self, text: str, add_special_tokens: bool = False) -> list[int]:
        try:
            res = http_request(
                self.base_url + "/tokenize",
                json={"prompt": text, "add_special_tokens": add_special_tokens},
                api_key=self.api_key,
            )
        except _CONNECTION_ERRORS as error:
            raise _unreachable(self.base_url, error) from error
        self._assert_success(res)
        return list(res.json()["tokens"])

    def fixed_ids(self, text: str) -> list[int]:
        """Token ids of a fixed string (a marker, a wait text), asked of the server once."""
        ids = self._fixed_ids.get(text)
        if ids is None:
            ids = self._fixed_ids[text] = self.tokenize(text)
        return list(ids)

    @functools.cached_property
    def token_exact(self) -> bool:
        """Whether the endpoint tokenizes (a server does; sglang-router has no ``/tokenize``
        and routes by text, so through it requests keep sending text)."""
        try:
            self.tokenize("a")
            return True
        except Exception:  # noqa: BLE001  (any failure: fall back to text, logged)
            logger.info("%s has no /tokenize: requests send text, not token ids", self.base_url)
            return False

    def _prompt_ids(self, s: StreamExecutor) -> list[int] | None:
        """The state's text as token ids: the last request's ids, then the new text tokenized.
        A state with no usable history is tokenized whole, as the server would tokenize it.
        None where ids cannot be used (images, an endpoint without ``/tokenize``)."""
        if s.images_ or not self.token_exact:
            return None
        text = s.text_
        known = s.variables.get(_IDS_VAR)
        if known is not None and text.startswith(known[0]):
            rest = text[len(known[0]):]
            return known[1] + (self.tokenize(rest) if rest else [])
        return self.tokenize(text, add_special_tokens=True)

    @staticmethod
    def _remember(s: StreamExecutor, text: str, ids: list[int]) -> None:
        s.variables[_IDS_VAR] = (text, ids)

    # -- every /generate request goes through here ----------------------------------------------
    def _post_generate(self, data: dict) -> dict | list[dict]:
        scope = self.cancel_scope
        rid = scope.start(data) if scope is not None else None
        try:
            res = http_request(self.base_url + "/generate", json=data, api_key=self.api_key)
            if scope is not None and scope.cancelled:
                raise ProgramCancelled("the program was cancelled; its requests were aborted")
            self._assert_success(res)
            obj = res.json()
        except _CONNECTION_ERRORS as error:
            raise _unreachable(self.base_url, error) from error
        finally:
            if rid is not None:
                scope.end(rid)
        for item in obj if isinstance(obj, list) else [obj]:
            self._record(item["meta_info"])
        return obj

    def _record(self, meta_info: dict) -> None:
        """One finished request: into this backend's ledger and any open ``track()`` block."""
        self.recorder.record(meta_info)
        tracking.record(self.base_url, meta_info)

    def _generate_http_request(self, s: StreamExecutor, data: dict):
        self._add_images(s, data)
        return self._post_generate(data)

    def commit_lazy_operations(self, s: StreamExecutor):
        ids = self._prompt_ids(s)
        prompt = {"text": s.text_} if ids is None else {"input_ids": ids}
        self._generate_http_request(s, {**prompt, "sampling_params": {"max_new_tokens": 0}})
        if ids is not None:
            self._remember(s, s.text_, ids)

    def fill_image(self, s: StreamExecutor):
        self.commit_lazy_operations(s)

    def _generate_request(self, s: StreamExecutor, sampling_params: SglSamplingParams
                          ) -> tuple[dict, list[int] | None]:
        """The ``/generate`` body of a ``gen`` (token ids where known, the state's extras) and
        the prompt's ids (None: sent as text)."""
        self._handle_dtype_to_regex(sampling_params)
        ids = self._prompt_ids(s)  # None: send text (images, no /tokenize)
        data = {
            **({"text": s.text_} if ids is None else {"input_ids": ids}),
            "sampling_params": {
                "skip_special_tokens": global_config.skip_special_tokens_in_output,
                "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                **sampling_params.to_srt_kwargs(),
            },
        }
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num",
                     "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                data[item] = value
        extras = dict(s.variables.pop(_EXTRAS_VAR, None) or {})
        for key in _SAMPLING_EXTRAS.intersection(extras):
            data["sampling_params"][key] = extras.pop(key)
        data.update(extras)
        self._add_images(s, data)
        return data, ids

    def generate(self, s: StreamExecutor, sampling_params: SglSamplingParams):
        data, ids = self._generate_request(s, sampling_params)
        obj = self._post_generate(data)
        meta = dict(obj["meta_info"])
        meta[OUTPUT_IDS_KEY] = obj.get("output_ids")
        # Only a completion cut by its length is exactly its ids: a stop string or EOS is in the
        # ids but not in the text. After those the prompt's ids are kept and the completion's
        # text is tokenized with whatever follows.
        if ids is not None:
            finish = (meta.get("finish_reason") or {}).get("type")
            if finish == "length" and meta[OUTPUT_IDS_KEY]:
                self._remember(s, s.text_ + obj["text"], ids + list(meta[OUTPUT_IDS_KEY]))
            else:
                self._remember(s, s.text_, ids)
        return obj["text"], meta

    def generate_stream(self, s: StreamExecutor, sampling_params: SglSamplingParams):
        """Yield ``(new text, meta_info)`` as the server streams; the request's cost is recorded
        once, from the last chunk's ``meta_info`` (a stream abandoned early records nothing:
        the server's counts arrive only with the end). Later requests of the state continue
        from the prompt's ids and tokenize the streamed text."""
        data, ids = self._generate_request(s, sampling_params)
        data["stream"] = True
        scope = self.cancel_scope
        rid = scope.start(data) if scope is not None else None
        try:
            res = http_request(self.base_url + "/generate", json=data, stream=True,
                               api_key=self.api_key)
        except BaseException as error:
            if rid is not None:
                scope.end(rid)
            if isinstance(error, (*_CONNECTION_ERRORS, requests.RequestException)):
                raise _unreachable(self.base_url, error) from error
            raise
        self._assert_success(res)
        prompt_text, pos, meta = s.text_, 0, None
        try:
            for line in _lines(res, self.base_url):
                line = line.decode("utf-8")
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:].strip())
                meta = dict(chunk["meta_info"])
                meta[OUTPUT_IDS_KEY] = chunk.get("output_ids")  # cumulative, as the text is
                text = chunk["text"][pos:]
                pos += len(text)
                yield text, meta
        finally:
            res.close()
            if rid is not None:
                scope.end(rid)
        if scope is not None and scope.cancelled:
            raise ProgramCancelled("the program was cancelled; its requests were aborted")
        if meta is not None:
            self._record(meta)
        if ids is not None:
            self._remember(s, prompt_text, ids)
