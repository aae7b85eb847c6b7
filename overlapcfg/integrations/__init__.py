"""Plugging the pass into other people's trainers. On top of the layers, beside the demo: an integration imports
the pass (``overlapcfg.passes``), configs and reports; nothing in overlapcfg imports an integration.

- ``overlapcfg.integrations.torchtitan``: a pass pipeline for torchtitan's graph trainer
  (``compile.pass_pipeline=overlapcfg``). Importing it imports torchtitan; ``import overlapcfg`` never does.
"""
