"""The torch trainer: what a trainer rank does with a request.

- ``dist``: the process group (file rendezvous, gloo/NCCL) and collectives that are no-ops alone;
- ``models``: causal LM and value model, loaded and saved as HF directories;
- ``microbatch``: minibatches, micro-batches (first-fit-decreasing under a token budget), padding;
- ``engine``: ``TorchEngine``, forward passes and data-parallel optimizer steps;
- ``stats``: statistics reduced over the ranks;
- ``interfaces``: the model function calls (actor/ref/critic inference, actor/critic/SFT train steps).

Nothing is imported here, so ``areal_hpc.train.dist`` can be used without loading transformers.
"""
