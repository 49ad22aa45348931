"""The trainer: what a trainer rank does with the controller's requests. The role's entry point is
`train.role`.

backends     the engine that holds one model on a rank, behind one seam (`make_engine`, `TrainEngine`)
worker       TrainerHandlers: the request handlers (initialize, inference, train_step, save, recover, weights)
interfaces   the model function calls (actor/ref/critic inference, actor/critic/SFT train steps)
numerics     token logprobs and entropy from logits, the optimizer and its learning-rate schedule
microbatch   minibatches, micro-batches (first-fit-decreasing under a token budget), padding
packed       a micro-batch as one packed row: attention within each sequence, no padding
head         token logprobs and entropy of the LM head in chunks of tokens (no [tokens, vocab] logits)
sharded      one rank's part of a sharded recover checkpoint: staged to shared memory, written in the background
shard_writer the process that writes a rank's checkpoint shards (not a thread: the GIL)
models       causal LM and value model, loaded from HF directories
stats        statistics reduced over the ranks
dist         the trainers' process group and collectives that are no-ops alone
rng          the random generators a recover checkpoint keeps (as JSON)
"""

from areal_hpc.train.backends import TrainEngine, make_engine
from areal_hpc.train.worker import TrainerHandlers, serve_trainer

__all__ = ["TrainEngine", "TrainerHandlers", "make_engine", "serve_trainer"]
