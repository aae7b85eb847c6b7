"""The graph layer: everything that reads or rewrites a ``torch.fx`` graph, and nothing that knows about configs
beyond a resolved plan.

``ops`` (the op vocabulary: collective starts, waits and kinds, byte-moving ops, in-place writes and aliases),
``collectives`` (find and classify), ``parameters`` (which graph inputs are parameter shards), ``gradients``
(which reductions reduce a gradient; shared weights' partials), ``attribution`` (which parameter and module each
collective serves), ``merge`` (bucketing), ``schedule`` (reordering), ``verify`` (proof), ``record`` (what a pass
did) and ``meta`` (where our data lives on nodes and graph modules, behind typed accessors). Private torch APIs
are reached through ``overlapcfg.compat`` only.
"""
