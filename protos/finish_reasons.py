"""Why a sample ended, as the scheduler's core names it and as the wire (common.proto FinishReason) carries it."""
from protos import common_pb2

FINISH_REASON_TO_PROTO = {None: common_pb2.FINISH_REASON_UNSPECIFIED, "length": common_pb2.FINISH_REASON_LENGTH,
                          "stop": common_pb2.FINISH_REASON_STOP, "abort": common_pb2.FINISH_REASON_ABORT}
FINISH_REASON_NAMES = {wire: name for name, wire in FINISH_REASON_TO_PROTO.items() if name is not None}
