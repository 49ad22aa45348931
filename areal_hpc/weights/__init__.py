"""Weight publication from the trainer to the generation servers.

bucket     the bucket plan, flatten and unflatten (pure), the sender's reused staging buffer (Stager)
group      the process group of trainer rank 0 and the servers (SGLang's weight-update group)
sender     trainer rank 0's end
receiver   a server's end
shared     tensors handed to a server of the same host (CUDA IPC, shared memory): weight_update_mode tensor
publisher  the controller's end: `publish(version) -> stats` as weight_update_mode says (broadcast, disk, tensor)
"""

from areal_hpc.weights.bucket import FieldError, metas_from_fields
from areal_hpc.weights.group import host_store
from areal_hpc.weights.publisher import (
    BroadcastPublisher,
    DiskPublisher,
    TensorPublisher,
    WeightSyncError,
    make_publisher,
)
from areal_hpc.weights.receiver import FLATTENED, ReceiverGroups
from areal_hpc.weights.sender import WeightSender, plan_payload
from areal_hpc.weights.shared import SharedWeights

__all__ = [
    "FLATTENED",
    "BroadcastPublisher",
    "DiskPublisher",
    "FieldError",
    "ReceiverGroups",
    "SharedWeights",
    "TensorPublisher",
    "WeightSender",
    "WeightSyncError",
    "host_store",
    "make_publisher",
    "metas_from_fields",
    "plan_payload",
]
