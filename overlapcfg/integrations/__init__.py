"""Plugging the pass into other people's trainers. On top of the layers, beside the demo: an integration imports
the pass (``overlapcfg.passes``), configs and reports; nothing in overlapcfg imports an integration.

- ``overlapcfg.integrations.torchtitan``: a pass pipeline for torchtitan's graph trainer
  (``compile.pass_pipeline=overlapcfg``); ``.fsdp2``: a ``parallelize_fn`` for its main trainer (eager FSDP2).
- ``overlapcfg.integrations.lightning``: a ``parallelize_fn`` for Lightning's ``ModelParallelStrategy``.
- ``overlapcfg.integrations.accelerate``: ``fully_shard(accelerator, model, cfg)`` for accelerate's FSDP2 plugin.
- ``trainer_checks``: what they share (release checks, faults in the trainer's terms); torch-free.

Importing an integration imports its trainer; ``import overlapcfg`` never does.
"""
