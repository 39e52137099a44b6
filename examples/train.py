"""Train and evaluate with BESS, in one process or one process per rank under torchrun.

python examples/train.py                              # 2 logical shards in one process
torchrun --nproc-per-node 4 examples/train.py         # 4 ranks, one entity shard each
"""

from pykeen.pipeline import pipeline

import pykeen_bess
from pykeen_bess.distributed import init_from_environment, is_main_process, save_to_directory

# under torchrun: join the process group (gloo on CPU, NCCL on GPU); else: nothing to do
in_group = init_from_environment() is not None

result = pipeline(
    dataset="nations",
    model="DistMult",
    model_kwargs=dict(embedding_dim=64),
    optimizer="adam",
    optimizer_kwargs=dict(lr=0.01),
    training_loop="bess",
    # under torchrun num_shards defaults to the world size (one shard per rank)
    training_loop_kwargs=dict(exchange="auto") if in_group else dict(num_shards=2, exchange="auto"),
    negative_sampler_kwargs=dict(num_negs_per_pos=64),
    training_kwargs=dict(num_epochs=100, batch_size=512),
    evaluator="bess",  # counts are all-reduced: every rank gets the same metrics
    random_seed=42,  # the seed of the run (without an explicit loop seed, every rank uses rank 0's)
)

# collective: gathers the entity shards on rank 0, which writes an ordinary PyKEEN model
save_to_directory(result, "bess-nations")
if is_main_process():
    print(f"pykeen-bess {pykeen_bess.__version__}: MRR {result.get_metric('mrr'):.3f}")
