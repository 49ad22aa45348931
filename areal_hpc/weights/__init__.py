"""Weight publication from the trainer to the generation servers.

bucket     the bucket plan, flatten and unflatten (pure), the sender's reused staging buffer (Stager)
group      the process group of trainer rank 0 and the servers (SGLang's weight-update group)
sender     trainer rank 0's end
receiver   a server's end
shared     tensors handed to a server of the same host (CUDA IPC, shared memory): weight_update_mode tensor
adapter    a LoRA adapter as a PEFT folder: written, read (checked), named by version, merged into its base
publisher  the controller's end: `publish(version) -> stats` as weight_update_mode says (broadcast, disk,
           tensor, adapter)
"""

from areal_hpc.weights.adapter import (
    Adapter,
    AdapterError,
    adapter_base,
    adapter_name,
    is_adapter_dir,
    merged,
    read_adapter,
    write_adapter,
    write_merged,
)
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
    "Adapter",
    "AdapterError",
    "adapter_base",
    "adapter_name",
    "is_adapter_dir",
    "merged",
    "read_adapter",
    "write_adapter",
    "write_merged",
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
