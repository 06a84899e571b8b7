"""The gRPC channel and server options every Ferry hop shares: messages up to 256 MiB (a long prompt's step)."""
MAX_MESSAGE_BYTES = 256 << 20
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
