"""``EmbeddedRuntime``: a real SGLang server for notebooks, scripts and tests."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import requests

from sgl_reason.runtime.server import ServerProcess, flag_value

logger = logging.getLogger(__name__)


class RequestError(RuntimeError):
    """The server refused a request; the message carries its reason and, where known, the fix."""

    @classmethod
    def from_response(cls, response: requests.Response, server_args: list[str]) -> "RequestError":
        try:
            message = response.json().get("message", response.text)
        except ValueError:
            message = response.text
        message = message.split("\n")[0]
        hint = ""
        if "exceeds the maximum allowed length" in message or "KV cache pool" in message:
            total = flag_value(server_args, "--max-total-tokens")
            hint = (
                f" The server's KV pool holds {total} tokens: restart it with a larger "
                "--max-total-tokens (at least the prompt plus max_new_tokens), or shorten the "
                "prompt."
            )
        elif "context length" in message:
            hint = " Shorten the prompt or lower max_new_tokens."
        return cls(f"The server refused the request (HTTP {response.status_code}): {message}{hint}")


class EmbeddedRuntime:
    """Start the SGLang HTTP server on a free port; stop every process it started on exit.

    >>> with EmbeddedRuntime() as rt:                 # the prepared default model
    ...     rt.set_default_backend()                  # sgl.function programs now run on it
    ...     print(rt.url, rt.server_info()["max_total_num_tokens"])

    ``extra_args`` are ``sglang.launch_server`` flags; on a machine without CUDA the CPU
    defaults of ``sgl-reason serve`` apply unless overridden there.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        port: int | None = None,
        extra_args: Sequence[str] = (),
        startup_timeout: float = 180.0,
        env: dict[str, str] | None = None,
    ):
        self._server = ServerProcess(
            model=model, port=port, extra_args=extra_args, env=env,
            log_sink=lambda line: logger.debug("[sglang] %s", line),
        )
        self._startup_timeout = startup_timeout
        self._endpoint = None
        self._previous_backend = None
        self._set_default = False

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> "EmbeddedRuntime":
        self._server.start(timeout=self._startup_timeout)
        return self

    def shutdown(self) -> None:
        if self._set_default:
            import sglang as sgl

            sgl.set_default_backend(self._previous_backend)
            self._set_default = False
        self._endpoint = None
        self._server.stop()

    def __enter__(self) -> "EmbeddedRuntime":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # access ----------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self._server.url

    @property
    def pid(self) -> int | None:
        """The server's process id, which is also its process-group id."""
        return self._server.pid

    @property
    def model_path(self) -> Path:
        return self._server.model

    @property
    def server(self) -> ServerProcess:
        return self._server

    @property
    def endpoint(self):
        """A :class:`~sgl_reason.backend.ReasonBackend` (an ``sgl.RuntimeEndpoint`` that records
        costs) bound to this server, created on first use."""
        if self._endpoint is None:
            from sgl_reason.backend import ReasonBackend

            self._endpoint = ReasonBackend(self.url)
        return self._endpoint

    def set_default_backend(self) -> None:
        """Make this server the frontend's default backend until :meth:`shutdown`."""
        import sglang as sgl
        from sglang.lang.global_config import global_config  # noqa: I001

        self._previous_backend = global_config.default_backend
        sgl.set_default_backend(self.endpoint)
        self._set_default = True

    def server_info(self) -> dict:
        return requests.get(self.url + "/get_server_info", timeout=10).json()

    def flush_cache(self, wait: float = 120.0) -> None:
        """Empty the radix cache, once the server is idle (:meth:`ReasonBackend.flush_cache`)."""
        self.endpoint.flush_cache(wait)

    def generate(self, text: str | list[str], **sampling_params) -> dict | list[dict]:
        """One ``/generate`` call with the given sampling parameters (no frontend involved)."""
        response = requests.post(
            self.url + "/generate",
            json={"text": text, "sampling_params": sampling_params},
            timeout=600,
        )
        if response.status_code != 200:
            raise RequestError.from_response(response, self.server.args)
        return response.json()
