"""The one exception hierarchy; each class carries the HTTP status it maps to.

    LoopserveError (500)
    ├── BadRequest (400)
    │   └── ClientGone (499, the caller disconnected: nobody reads the answer)
    ├── NotFound (404)
    ├── PayloadTooLarge (413)
    ├── UnsupportedMediaType (415)
    ├── Unprocessable (422)
    ├── ModelError (500, the model failed on this input)
    ├── Overloaded (503, with Retry-After)
    │   └── ShuttingDown (503)
    └── DeadlineExceeded (504)

The app's single handler turns any of them into ``{"error": message}``.
Anything else that escapes is a bug: it is logged and answered 500 without
internals.
"""

from __future__ import annotations


class LoopserveError(Exception):
    status = 500
    reason = "error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def headers(self) -> dict[str, str]:
        return {}


class BadRequest(LoopserveError):
    status = 400
    reason = "bad_input"


class ClientGone(BadRequest):
    status = 499
    reason = "client_gone"


class NotFound(LoopserveError):
    status = 404
    reason = "not_found"


class PayloadTooLarge(LoopserveError):
    status = 413
    reason = "bad_input"


class UnsupportedMediaType(LoopserveError):
    status = 415
    reason = "bad_input"


class Unprocessable(LoopserveError):
    status = 422
    reason = "bad_input"


class ModelError(LoopserveError):
    status = 500
    reason = "model_error"


class Overloaded(LoopserveError):
    status = 503
    reason = "overload"

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class ShuttingDown(Overloaded):
    reason = "shutdown"


class DeadlineExceeded(LoopserveError):
    status = 504
    reason = "timeout"


class SettingsError(ValueError):
    """Bad configuration: stops the start, naming the field and the value."""
