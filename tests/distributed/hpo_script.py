"""An ordinary hpo_pipeline script (no pykeen_bess imports); the tests run it under torchrun.

Writes ``rank{r}.json`` (trial states and parameters) to the directory ``OUTPUT``.
"""

import json
import os
import pathlib

from pykeen.hpo import hpo_pipeline

result = hpo_pipeline(
    dataset="nations",
    model="DistMult",
    model_kwargs=dict(embedding_dim=4),
    training_loop="bess",
    training_loop_kwargs=dict(num_shards=3),  # under torchrun: must equal the world size
    training_kwargs=dict(num_epochs=1, use_tqdm=False),
    evaluator="bess",
    evaluation_kwargs=dict(use_tqdm=False),
    n_trials=2,
    # every rank must draw the same trials
    sampler="random",
    sampler_kwargs=dict(seed=int(os.environ.get("SAMPLER_SEED", "0"))),
)
output = pathlib.Path(os.environ["OUTPUT"])
output.mkdir(parents=True, exist_ok=True)
trials = [dict(state=t.state.name, params=t.params, value=t.value) for t in result.study.trials]
(output / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(trials))
