"""The one error type that crosses Ferry's edges: a gRPC status code and the reason a caller reads."""
import grpc


class StatusError(Exception):
    """Raised inside a service; its edge turns it into a gRPC status (or an HTTP code) with `message`."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message
