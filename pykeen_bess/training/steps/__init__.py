"""The training step: one function of fixed shapes per step kind, and the executors that run it.

* :mod:`~pykeen_bess.training.steps.static_step`: the step (plan slots -> rows -> scores -> loss ->
  gradients -> row and dense updates) with fixed shapes and no host read, over the epoch's plan on
  the device (:mod:`~pykeen_bess.training.steps.device_plan`);
* :mod:`~pykeen_bess.training.steps.runner`: the loss of a step's slots (over sub-batches), the
  gradient hand-off and the optimizer step composed of training callbacks (global-norm clipping);
* :mod:`~pykeen_bess.training.steps.static_update`: the optimizer's updates on the device (their gated
  rules in :mod:`~pykeen_bess.training.steps.static_rules`; on the CPU the distinct rows' updates in
  :mod:`~pykeen_bess.training.steps.host_rows`; the replicated parameters by the user's optimizer in
  :mod:`~pykeen_bess.training.steps.dense_update`);
* :mod:`~pykeen_bess.training.steps.executors`: run the step directly, or capture it as CUDA graphs
  and replay them.
"""
