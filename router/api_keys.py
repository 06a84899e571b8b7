"""The API keys clients present to the router (`Authorization: Bearer <key>` on HTTP, the same as gRPC metadata).
Each key is one client for the per-key limits (router/limits.py); with no key configured every call is accepted
and all callers share one budget."""
from __future__ import annotations

import argparse
from pathlib import Path

from base import environment
from base.cluster_auth import matching_key


def add_api_key_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", action="append", default=[],
                        help="a key every gRPC and /v1 HTTP call must carry (repeatable: one per client; default: "
                             "$FERRY_API_KEY, comma-separated; none: no key needed)")
    parser.add_argument("--api-key-file", default="", help="more keys, one a line")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys the flags give (else $FERRY_API_KEY's); ValueError when --api-key-file cannot be read."""
    keys = list(args.api_key) or environment.FERRY_API_KEY.split(",")
    if args.api_key_file:
        try:
            keys += Path(args.api_key_file).read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file}: {e.strerror}") from e
    return list(dict.fromkeys(k.strip() for k in keys if k.strip()))


def presented_key(keys: list[str], authorization: str) -> str | None:
    """The configured key an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata) carries; None when
    it carries none of them."""
    return matching_key(keys, bearer_token(authorization))


def bearer_token(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
