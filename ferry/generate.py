"""`ferry generate`: a streamed completion through the router, over its gRPC API."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from base import environment


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("generate", help="stream a completion through the router")
    parser.add_argument("prompt")
    parser.add_argument("--router", default="127.0.0.1:50051")
    parser.add_argument("--chat", action="store_true", help="send the prompt as a user chat message")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--api-key", default=environment.FERRY_API_KEY, help="the router's API key, if set")
    parser.add_argument("--tls-ca", default="", help="the router serves TLS: check its certificate with this CA")
    parser.set_defaults(handler=run_generate)


def generate_request(args: argparse.Namespace):
    from protos import common_pb2, router_pb2

    sampling = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, stop=args.stop)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    if args.seed is not None:
        sampling.seed = args.seed
    request = router_pb2.GenerateRequest(sampling=sampling)
    if args.chat:
        request.chat.messages.add(role="user", content=args.prompt)
    else:
        request.text = args.prompt
    return request


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from protos import router_pb2_grpc

    channel = (grpc.secure_channel(args.router, grpc.ssl_channel_credentials(Path(args.tls_ca).read_bytes()))
               if args.tls_ca else grpc.insecure_channel(args.router))
    with channel:
        try:
            metadata = [("authorization", f"Bearer {args.api_key}")] if args.api_key else None
            for response in router_pb2_grpc.RouterStub(channel).Generate(generate_request(args), metadata=metadata):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.HasField("usage"):
                    sys.stdout.write("\n")
                    print(f"[{response.usage.prompt_tokens} prompt + {response.usage.completion_tokens} "
                          f"completion tokens]", file=sys.stderr)
        except grpc.RpcError as e:
            print(f"\nferry generate: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0
