"""Data: prompt datasets and their sampler, packed batch files (HDF5), the rollout store, SFT sequences.

dataset  the JSONL prompt format, tokenized datasets, ShardedSampler (resumable, sharded by global rank)
code_tests  a code task's test cases (the original's input_output)
batch    packed arrays of sequences in HDF5 batch files: write, read, select, gather by reference
store    RolloutStore: finished groups of asynchronous RL waiting to be trained on
sft      supervised warm-up sequences (prompt + reference solution)
"""

from areal_hpc.data.batch import (
    CU,
    ROUTED_EXPERTS,
    BatchError,
    gather,
    read_attrs,
    read_batch,
    read_keys,
    select,
    write_batch,
)
from areal_hpc.data.code_tests import CodeTests, CodeTestsError, parse_code_tests
from areal_hpc.data.dataset import (
    DatasetFormatError,
    PromptDataset,
    PromptSample,
    Record,
    SamplerStateError,
    ShardedSampler,
    load_prompt_dataset,
    prompts_of,
    read_jsonl,
    read_prompt_records,
    run_steps,
    training_prompts,
)
from areal_hpc.data.sft import sft_arrays
from areal_hpc.data.store import RolloutStore

__all__ = [
    "CU",
    "ROUTED_EXPERTS",
    "BatchError",
    "CodeTests",
    "CodeTestsError",
    "DatasetFormatError",
    "PromptDataset",
    "PromptSample",
    "Record",
    "RolloutStore",
    "SamplerStateError",
    "ShardedSampler",
    "gather",
    "load_prompt_dataset",
    "parse_code_tests",
    "prompts_of",
    "read_attrs",
    "read_batch",
    "read_jsonl",
    "read_keys",
    "read_prompt_records",
    "run_steps",
    "select",
    "sft_arrays",
    "training_prompts",
    "write_batch",
]
