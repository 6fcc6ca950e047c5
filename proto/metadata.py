"""gRPC metadata keys of the wire contract (`rlfeed.proto` documents them with the calls).

Shared by the server that sets them and the clients that read them; standard library only.
"""

# Trailing metadata of a RESOURCE_EXHAUSTED answer to SubmitRollouts/SubmitRolloutBatch:
# the milliseconds (decimal ASCII) the sidecar suggests waiting before sending the batch again.
RETRY_AFTER_MS = "rlfeed-retry-after-ms"
