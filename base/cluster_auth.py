"""What Ferry's services present to each other inside a cluster: the cluster token a router sends on every scheduler
call (gRPC metadata, compared in constant time; without it a scheduler answers UNAUTHENTICATED and logs the peer),
and the password of the Redis they share. Both are distinct from the API keys clients send to the router, which
the router checks with the same constant-time `matching_key`.
"""
from __future__ import annotations

import argparse
import hmac
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from base import environment

log = logging.getLogger(__name__)
TOKEN_METADATA_KEY = "x-ferry-cluster-token"
SCHEDULER_METHODS = "/ferry.Scheduler/"   # what the token guards; health checking stays open for probes


def add_secret_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster-token", default=environment.FERRY_CLUSTER_TOKEN,
                        help="secret routers present to schedulers on every call (default: $FERRY_CLUSTER_TOKEN; "
                             "empty: schedulers accept any caller)")
    parser.add_argument("--cluster-token-file", default="", help="read the cluster token from this file")
    parser.add_argument("--redis-password", default=environment.FERRY_REDIS_PASSWORD,
                        help="password of --redis-url (default: $FERRY_REDIS_PASSWORD; a password in the URL wins)")
    parser.add_argument("--redis-password-file", default="", help="read the Redis password from this file")


@dataclass(frozen=True)
class ClusterSecrets:
    cluster_token: str = ""
    redis_password: str = ""


def cluster_secrets(args: argparse.Namespace) -> ClusterSecrets:
    """The secrets the flags name; ValueError naming the flag when a file cannot be read or is empty."""
    return ClusterSecrets(secret_value(args.cluster_token, args.cluster_token_file, "--cluster-token-file"),
                          secret_value(args.redis_password, args.redis_password_file, "--redis-password-file"))


def secret_value(value: str, path: str, flag: str) -> str:
    if not path:
        return value
    try:
        text = Path(path).read_text().strip()
    except OSError as e:
        raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from e
    if not text:
        raise ValueError(f"{flag}: {path} is empty")
    return text


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a call to a scheduler carries."""
    return ((TOKEN_METADATA_KEY, token),) if token else ()


def token_matches(metadata, token: str) -> bool:
    sent = dict(metadata or ()).get(TOKEN_METADATA_KEY, "")
    return matching_key([token], str(sent)) is not None


def matching_key(keys: list[str], sent: str) -> str | None:
    """The key among `keys` equal to `sent` (a cluster token, an API key), compared in constant time against
    every key; None when none is."""
    found = None
    for key in keys:
        if hmac.compare_digest(sent.encode(), key.encode()):
            found = key
    return found


class ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call under `guarded` that lacks the token, before the service's own handler runs."""

    def __init__(self, token: str, guarded: str = SCHEDULER_METHODS):
        self.token = token
        self.guarded = guarded

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable],
                                details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.guarded):
            return handler
        if token_matches(details.invocation_metadata, self.token):
            return handler
        return refusal(handler, details.method)


def refusal(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that answers UNAUTHENTICATED and does nothing else."""
    async def refuse(_request, context: grpc.aio.ServicerContext) -> None:
        log.warning("refused %s from %s: missing or wrong cluster token", method, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[(handler.request_streaming,
                                                                  handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
