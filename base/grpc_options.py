"""The gRPC channel and server options every Ferry hop shares: messages up to 256 MiB (a long prompt's step) on
both ends; servers accept the keepalive pings clients send (a peer that stops answering them is dead)."""
MAX_MESSAGE_BYTES = 256 << 20
MIN_PING_INTERVAL_MS = 500          # what servers accept: clients ping no more often than keepalive_options allow
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
                ("grpc.keepalive_permit_without_calls", 1)]


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """A client's pings: one after `seconds` of silence, and the connection declared dead (its calls failing with
    UNAVAILABLE) when the answer takes longer than that again."""
    interval_ms = max(MIN_PING_INTERVAL_MS, int(seconds * 1000))
    return [("grpc.keepalive_time_ms", interval_ms), ("grpc.keepalive_timeout_ms", interval_ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.ping_timeout_ms", interval_ms)]   # gRPC core waits for a ping's answer this long (60 s)
