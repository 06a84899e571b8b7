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
    parser.add_argument("--api-key-file", default="",
                        help="more keys, one a line: 'KEY', or 'KEY TENANT' (its requests are that tenant's), or "
                             "'KEY *' (a gateway: its callers name the tenant in the x-ferry-tenant header)")


def api_keys(args: argparse.Namespace) -> list[str]:
    """The keys the flags give (else $FERRY_API_KEY's); ValueError when --api-key-file cannot be read."""
    keys = list(args.api_key) or environment.FERRY_API_KEY.split(",")
    keys += [key for key, _ in key_file_lines(args.api_key_file)]
    return list(dict.fromkeys(k.strip() for k in keys if k.strip()))


def key_tenants(args: argparse.Namespace) -> dict[str, str]:
    """The tenant each key of --api-key-file names (router/tenants.py), for those that name one."""
    return {key: tenant for key, tenant in key_file_lines(args.api_key_file) if tenant}


def key_file_lines(path: str) -> list[tuple[str, str]]:
    """(key, tenant or "") of each line of the key file; ValueError when it cannot be read or a line has more than
    a key and a tenant."""
    if not path:
        return []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"--api-key-file: cannot read {path}: {e.strerror}") from e
    entries = []
    for number, line in enumerate(lines, 1):
        words = line.split()
        if len(words) > 2:
            raise ValueError(f"--api-key-file line {number}: expected 'KEY' or 'KEY TENANT', got {len(words)} words")
        if words:
            entries.append((words[0], words[1] if len(words) == 2 else ""))
    return entries


def presented_key(keys: list[str], authorization: str) -> str | None:
    """The configured key an `Authorization: Bearer <key>` value (HTTP header or gRPC metadata) carries; None when
    it carries none of them."""
    return matching_key(keys, bearer_token(authorization))


def bearer_token(authorization: str) -> str:
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
