"""The graph layer: everything that reads or rewrites a ``torch.fx`` graph. Of configs it knows the resolved plan
(``overlapcfg.resolve``) and two words of the policy's vocabulary (``BucketMode``, ``IssueOrder``), never a whole
config: whoever calls it resolves one (``overlapcfg.passes``).

``ops`` (the op vocabulary: collective starts, waits and kinds, byte-moving ops, in-place writes and aliases),
``collectives`` (find and classify), ``parameters`` (which graph inputs are parameter shards), ``gradients``
(which reductions reduce a gradient; shared weights' partials), ``attribution`` (which parameter and module each
collective serves), ``merge`` with ``bucket_fns``, ``stamp``, ``traces``, ``fresh_values`` and ``byte_runs``
(bucketing), ``placement``, ``reach`` and ``schedule`` (reordering), ``verify`` with ``summary``, ``provenance``,
``memory`` and ``well_formed`` (proof), ``record`` (what a pass did) and ``meta`` (where our data lives on nodes and
graph modules, behind typed accessors), ``fingerprint`` (the collectives a graph will issue, as ranks compare them),
``same_schedule`` (that comparison across the ranks of each process group, through the job's c10d store: the one
module here that talks to other ranks, used by the passes and the FSDP2 driver alike) and ``agreement`` (decisions
made on rank 0 for every rank: the tuner's). Private torch APIs are reached through ``overlapcfg.compat`` only.
"""
