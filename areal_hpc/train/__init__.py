"""The trainer: what a trainer rank does with the controller's requests. The role's entry point is
`train.role`.

backends    the engine that holds one model on a rank, behind one seam (`make_engine`, `TrainEngine`)
worker      TrainerHandlers: the request handlers (initialize, inference, train_step, save, recover, weights)
interfaces  the model function calls (actor/ref/critic inference, actor/critic/SFT train steps)
numerics    token logprobs and the learning-rate schedule, shared by the backends
microbatch  minibatches, micro-batches (first-fit-decreasing under a token budget), padding
models      causal LM and value model, loaded and saved as HF directories
stats       statistics reduced over the ranks
dist        the trainers' process group and collectives that are no-ops alone
rng         the random generators a recover checkpoint keeps
"""

from areal_hpc.train.backends import TrainEngine, make_engine
from areal_hpc.train.worker import TrainerHandlers, serve_trainer

__all__ = ["TrainEngine", "TrainerHandlers", "make_engine", "serve_trainer"]
